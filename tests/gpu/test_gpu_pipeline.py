"""Pipeline stages on GPUs: the stages of a replica on their own GPUs, activations over NCCL; on one GPU,
stages that would share it over gloo are refused in one line (gloo sends no GPU tensors point to point)."""

import subprocess
import sys

import pytest
import torch

from .runs import ROOT, local_env, max_diff, train_cmd
from p2p_spy import pairs_used

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


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs: one a stage")
def test_nccl_pairs_of_evaluation_and_checkpoints_are_built_at_start_up(tmp_path):
    """Under NCCL a pair's first single send builds its two-rank communicator: every pair evaluation and
    the checkpoints use has exchanged by the end of start-up (pipeline.p2p_pairs), on the GPUs."""
    stages = min(3, torch.cuda.device_count())
    run_dir = tmp_path / "run"
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "p2p_spy.py"), str(ROOT / "recipes" / "digits.toml"),
                        str(run_dir), "data.name=synthetic", "data.synthetic_size=1440", f"parallel.stages={stages}",
                        f"cluster.gpus_per_node={stages}", "train.device=cuda", "cluster.timeout_s=60"],
                       env=local_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    for rank in range(stages):
        used = pairs_used(run_dir, rank)
        assert used["after"] and used["after"] <= used["start"], (rank, used)
