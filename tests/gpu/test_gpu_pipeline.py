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
