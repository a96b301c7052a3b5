"""Pipeline stages on GPUs: the stages of a replica on their own GPUs, activations over NCCL; on one GPU,
stages that would share it over gloo are refused in one line (gloo sends no GPU tensors point to point)."""

import subprocess

import pytest
import torch

from .runs import ROOT, local_env, max_diff, train_cmd

pytestmark = pytest.mark.gpu

EXACT = ["model.name=resnet8", "model.norm=group", "optim.name=sgd", "optim.schedule=constant",
         "optim.warmup_steps=0", "data.augment=none", "train.deterministic=true", "train.steps=5", "data.workers=0",
         "train.log_every=1", "train.warmup_log_steps=0", "data.batch_size=16", "train.device=cuda"]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs: one a stage")
def test_two_stages_on_two_gpus_match_one_gpu(train_run):
    one = train_run("one", *EXACT)
    two = train_run("two", *EXACT, "parallel.stages=2", "cluster.gpus_per_node=2")
    assert max_diff(one.weights, two.weights) <= 1e-4  # GPU kernels differ in their sums' order by layer
    stages = two.summary["pipeline"]["stages"]
    assert len(stages) == 2 and all(0 < s["peak_memory_bytes"] for s in stages)  # the allocator's peaks
    assert all(0 <= s["idle_fraction"] < 1 for s in stages)


def test_stages_sharing_one_gpu_over_gloo_are_refused(tmp_path):
    r = subprocess.run(train_cmd(tmp_path / "shared", *EXACT, "parallel.stages=2", "cluster.gpus_per_node=2",
                                 "cluster.backend=gloo"), env=local_env(), cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode != 0 and "parallel.stages on GPUs needs NCCL" in r.stderr, r.stderr[-2000:]


# A replica's stages on their own GPUs (NCCL), every single send and receive recorded as (sender, receiver)
# by a pass-through around torch.distributed's, at start-up (to the end of job.wrap) and after.
SPIED = """
import json, sys
import torch.distributed as dist
import scaletrain

used, phase, send, recv = {"start": [], "after": []}, ["start"], dist.send, dist.recv

def spy_send(tensor, *args, **kwargs):
    used[phase[0]].append((dist.get_rank(), kwargs["dst"]))
    return send(tensor, *args, **kwargs)

def spy_recv(tensor, *args, **kwargs):
    used[phase[0]].append((kwargs["src"], dist.get_rank()))
    return recv(tensor, *args, **kwargs)

dist.send, dist.recv = spy_send, spy_recv
stages = int(sys.argv[3])
cfg = scaletrain.load_config(sys.argv[1], ["data.name=synthetic", "data.synthetic_size=1440", f"parallel.stages={stages}",
                                           f"cluster.gpus_per_node={stages}", "model.name=resnet8", "train.device=cuda",
                                           "train.steps=4", "train.eval_every=2", "train.checkpoint_every=2",
                                           "data.workers=0", "cluster.timeout_s=60"])
with scaletrain.Job.from_env(cfg, run_dir=sys.argv[2]) as job:
    job.wrap(scaletrain.build_model(cfg.model))
    phase[0] = "after"
    for x, y in job.batches():
        job.step(job.forward_backward(x, y))
    rank = job.ctx.me.rank
with open(f"{sys.argv[2]}/p2p{rank}.json", "w") as f:
    json.dump(used, f)
"""


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs: one a stage")
def test_nccl_pairs_of_evaluation_and_checkpoints_are_built_at_start_up(tmp_path):
    """Under NCCL a pair's first single send builds its two-rank communicator: every pair evaluation and
    the checkpoints use has exchanged by the end of start-up (pipeline.p2p_pairs), on the GPUs."""
    import json
    import sys

    stages = min(3, torch.cuda.device_count())
    path, run_dir = tmp_path / "spied.py", tmp_path / "run"
    path.write_text(SPIED)
    r = subprocess.run([sys.executable, str(path), str(ROOT / "recipes" / "digits.toml"), str(run_dir), str(stages)],
                       env=local_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    for rank in range(stages):
        used = {k: {frozenset(p) for p in v} for k, v in json.loads((run_dir / f"p2p{rank}.json").read_text()).items()}
        assert used["after"] and used["after"] <= used["start"], (rank, used)
