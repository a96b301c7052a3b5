"""The gradient noise scale measured where training measures it: in the communication hook of a
real DistributedDataParallel over two gloo processes (strategies/allreduce.py), on the linear problem
of tests/unit/test_noise.py whose answer is known; and recorded in a real job's outputs."""

import json
import subprocess

import pytest

from conftest import ROOT, run_gloo_pair, scaletrain_cmd

HOOKED = """
import datetime, json, math, os, sys
import torch, torch.distributed as dist
from scaletrain.noise import NoiseScale
from scaletrain.strategies.allreduce import data_parallel

rank, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=60))
D, b = 10, 16
model = torch.nn.Linear(D, 1, bias=False)
with torch.no_grad():
    model.weight.fill_(1 / math.sqrt(D))  # w = w* + delta with w* = 0, |delta| = 1: B_simple = 21
noise = NoiseScale(b, 2 * b, torch.device("cpu"))
ddp = data_parallel(model, None, noise=noise)
gen = torch.Generator().manual_seed(rank)
for window in range(30):
    for _ in range(100):
        x, e = torch.randn(b, D, generator=gen), torch.randn(b, generator=gen)
        model.zero_grad(set_to_none=False)
        (0.5 * (ddp(x).squeeze(1) - e).pow(2).mean()).backward()
        noise.step()
    noise.window()
with open(f"{out}/noise{rank}.json", "w") as f:
    json.dump([noise.value, noise.overall], f)
dist.destroy_process_group()
os._exit(0)  # no interpreter teardown (launch/join.exit_now says why)
"""


def test_the_ddp_hook_measures_the_known_noise_scale(tmp_path):
    run_gloo_pair(tmp_path, "hooked.py", HOOKED)
    for r in range(2):
        value, overall = json.loads((tmp_path / f"noise{r}.json").read_text())
        assert value == pytest.approx(21.0, rel=0.10) and overall == pytest.approx(21.0, rel=0.10)


def test_a_job_records_its_noise_scale_in_its_rows_and_summary(tmp_path):
    run_dir = tmp_path / "run"
    r = subprocess.run(scaletrain_cmd("train", "--recipe", str(ROOT / "recipes" / "digits.toml"), "--run-dir",
                                      str(run_dir), "--quiet", "--set", "cluster.gpus_per_node=2", "--set",
                                      "train.steps=60", "--set", "data.workers=0"),
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    measured = [row["noise_scale"] for row in rows if row["kind"] == "train" and "noise_scale" in row]
    assert len(measured) == 3 and all(v > 0 for v in measured)  # a value at each log point (every 20 steps)
    assert summary["noise_scale"] > 0  # the run's own: its mean tr(Sigma) over its mean |G|^2 (noise.overall)
