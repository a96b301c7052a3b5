"""Staleness-aware asynchronous updates: strategy.staleness_lr = inverse and DC-ASGD's
strategy.delay_compensation, on a real PS shard (three processes, the real protocol) and in
the one-process emulator."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scaletrain.cli import main
from scaletrain.config import ConfigError, load_config
from scaletrain.optim import compensate, staleness_scale

ROOT = Path(__file__).resolve().parents[2]
DIGITS = str(ROOT / "recipes/digits.toml")
LR, LAMBDA = 0.5, 2.0
SHARD = ["optim.name=sgd", "optim.momentum=0", "optim.weight_decay=0", "optim.schedule=constant",
         "optim.warmup_steps=0", f"optim.lr={LR}", "strategy.name=async", "cluster.num_ps=1",
         "train.eval_every=0", "train.checkpoint_every=0"]

# Rank 0 serves one async shard; ranks 1 and 2 push known gradients in a fixed order (a barrier
# between them): 1 on version 0, 2 on version 0 (1 stale), 1 on version 1 (1 stale). Each pusher
# writes the values it was answered with.
SCRIPT = r'''
import json, sys, datetime
import torch, torch.distributed as tdist
from scaletrain.config import load_config
from scaletrain.models import build_model
from scaletrain.ps import protocol as P
from scaletrain.ps.server import Shard
from scaletrain.schedule import Schedule

rank, port, out, sets = int(sys.argv[1]), sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
torch.set_num_threads(1)
tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3,
                         timeout=datetime.timedelta(seconds=60))
pushers = tdist.new_group([1, 2])
cfg = load_config(sets[0], sets[1:])
if rank == 0:
    shard = Shard(cfg, 0, [1, 2], "async", 1, Schedule(step_images=8, steps=100), 8, 8)
    torch.save(shard.values.detach().clone(), f"{out}/w0.pt")
    shard.serve()
    json.dump(shard.hist[:3].tolist(), open(f"{out}/hist.json", "w"))
else:
    n = sum(p.numel() for p in build_model(cfg.model).parameters())
    replies = []
    def push(version, seed):
        g = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 0.1
        hdr, vals = torch.zeros(P.HEADER, dtype=torch.int64), torch.empty(n)
        works = [tdist.irecv(hdr, src=0, tag=P.TAG_REPLY_HDR), tdist.irecv(vals, src=0, tag=P.TAG_REPLY_VALS)]
        tdist.send(P.header(version, P.PUSH, 0), dst=0, tag=P.TAG_HDR)
        tdist.send(g, dst=0, tag=P.TAG_VALS)
        for w in works:
            w.wait()
        replies.append({"version": int(hdr[0]), "values": vals.tolist()})
    if rank == 1:
        push(0, 1)
    tdist.barrier(group=pushers)
    if rank == 2:
        push(0, 2)
    tdist.barrier(group=pushers)
    if rank == 1:
        push(1, 3)
    tdist.barrier(group=pushers)
    tdist.send(P.header(0, P.STOP, 0), dst=0, tag=P.TAG_HDR)
    json.dump(replies, open(f"{out}/replies{rank}.json", "w"))
tdist.destroy_process_group()
'''


def serve_three_pushes(tmp_path: Path, *sets: str) -> tuple[torch.Tensor, dict, list]:
    from scaletrain.launch.local import free_port

    script = tmp_path / "shard.py"
    script.write_text(SCRIPT)
    port = str(free_port("127.0.0.1"))
    procs = [subprocess.Popen([sys.executable, str(script), str(r), port, str(tmp_path),
                               json.dumps([DIGITS, *SHARD, *sets])], stderr=subprocess.PIPE, text=True)
             for r in range(3)]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    replies = {r: json.loads((tmp_path / f"replies{r}.json").read_text()) for r in (1, 2)}
    return torch.load(tmp_path / "w0.pt"), replies, json.loads((tmp_path / "hist.json").read_text())


def gradient(seed: int, n: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 0.1


@pytest.mark.parametrize("inverse,lam", [(False, 0.0), (True, 0.0), (True, LAMBDA)])
def test_async_shard_scales_and_compensates_stale_gradients(tmp_path, inverse, lam):
    sets = [*(["strategy.staleness_lr=inverse"] if inverse else []), f"strategy.delay_compensation={lam}"]
    w0, replies, hist = serve_three_pushes(tmp_path, *sets)
    g1, g2, g3 = (gradient(s, w0.numel()) for s in (1, 2, 3))
    scale = 0.5 if inverse else 1.0  # the two later gradients are 1 update stale
    w1 = w0 - LR * g1
    w2 = w1 - LR * scale * (g2 + lam * g2 * g2 * (w1 - w0))  # pusher 2 computed on w0
    w3 = w2 - LR * scale * (g3 + lam * g3 * g3 * (w2 - w1))  # pusher 1 computed on w1, its last reply
    assert hist == [1, 2, 0]
    assert [r["version"] for r in replies[1]] == [1, 3] and [r["version"] for r in replies[2]] == [2]
    for got, want in ((replies[1][0], w1), (replies[2][0], w2), (replies[1][1], w3)):
        assert torch.allclose(torch.tensor(got["values"]), want, rtol=0, atol=1e-6)
    if lam:  # the correction is not lost in rounding: without it the last values differ
        plain = w2 - LR * scale * g3
        assert (torch.tensor(replies[1][1]["values"]) - plain).abs().max() > 1e-4


def test_staleness_scale_and_compensate_by_hand():
    assert staleness_scale("none", 7) == 1.0 and staleness_scale("inverse", 0) == 1.0
    assert staleness_scale("inverse", 3) == 0.25
    g, now, then = torch.tensor([1.0, -2.0, 0.5]), torch.tensor([0.3, 0.1, -1.0]), torch.tensor([0.1, 0.2, -1.0])
    out = compensate(g.clone(), now, then, 0.5, torch.empty(3))
    assert torch.allclose(out, torch.tensor([1.0 + 0.5 * 1 * 0.2, -2.0 + 0.5 * 4 * -0.1, 0.5]))
    assert torch.equal(compensate(g.clone(), now, then, 0.5), out)  # with or without the buffer


# --- the emulator ------------------------------------------------------------------------------

EMU = ["model.norm=group", "optim.schedule=constant", "optim.warmup_steps=0", "data.augment=none",
       "train.deterministic=true", "train.steps=30", "data.workers=0", "train.eval_every=0", "train.log_every=10"]


def emulated(tmp_path, name, *sets):
    from safetensors.torch import load_file

    run_dir = tmp_path / name
    assert main(["train", "--recipe", DIGITS, "--run-dir", str(run_dir), "--quiet",
                 *sum((["--set", s] for s in (*EMU, *sets)), [])]) == 0
    return load_file(str(run_dir / "model.safetensors"))


def max_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_emulator_staleness_aware_updates(tmp_path):
    aware = ("strategy.staleness_lr=inverse", "strategy.delay_compensation=100")
    # one worker: nothing is stale, so both act as plain training, exactly
    assert max_diff(emulated(tmp_path, "one", "strategy.emulate_workers=1"),
                    emulated(tmp_path, "one-aware", "strategy.emulate_workers=1", *aware)) == 0.0
    four = emulated(tmp_path, "four", "strategy.emulate_workers=4")
    inverse = emulated(tmp_path, "four-inverse", "strategy.emulate_workers=4", aware[0])
    dc = emulated(tmp_path, "four-dc", "strategy.emulate_workers=4", aware[1])
    assert max_diff(four, inverse) > 1e-3 and max_diff(four, dc) > 1e-6 and max_diff(inverse, dc) > 1e-3


def test_staleness_aware_updates_need_asynchronous_ones():
    with pytest.raises(ConfigError, match=r"strategy.staleness_lr = inverse: acts on asynchronous updates.*'sync'"):
        load_config(DIGITS, ["strategy.name=sync", "cluster.nodes=2", "cluster.num_ps=1",
                             "strategy.staleness_lr=inverse"])
    with pytest.raises(ConfigError, match="strategy.delay_compensation = 0.5"):
        load_config(DIGITS, ["strategy.delay_compensation=0.5"])
    load_config(DIGITS, ["strategy.name=mixed-async", "cluster.nodes=2", "cluster.num_ps=1",
                         "strategy.delay_compensation=0.5", "strategy.staleness_lr=inverse"])
