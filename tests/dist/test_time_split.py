"""time_split_s adds up: compute, intra-node and communication seconds of a worker account for its
steps, with real processes (gloo) on emulated GPUs (train.emulate_compute_s).

One node is slowed, so the other waits for it in every step's communication: a split that left that
wait out (a timer missing, or one that reads a queued collective as done) falls short of the step
by half the delay, well outside the bound below."""

import json

import pytest

from scaletrain.cli import main

from conftest import RECIPES

T, DELAY, STEPS = 0.02, 0.08, 30
# Stated bound: the split's parts, summed, are within [LOW, HIGH] of the step's seconds. Below 1:
# what no timer covers (the optimizer's step, the loop's own work, the first step's wait for the
# other process). A split without the wait would be near (T + DELAY / 2) / (T + DELAY) = 0.6.
LOW, HIGH = 0.8, 1.1
BASE = ["train.eval_every=0", "data.workers=0", f"train.steps={STEPS}", "train.log_every=10",
        "train.warmup_log_steps=2", "data.batch_size=8", "train.checkpoint_every=0", "optim.schedule=constant",
        "optim.warmup_steps=0", "train.threads=1", f"train.emulate_compute_s={T}", "cluster.nodes=2",
        "strategy.slow_node=1", f"strategy.slow_delay_s={DELAY}"]


def run(tmp_path, name, *overrides):
    run_dir = tmp_path / name
    args = ["train", "--recipe", str(RECIPES / "digits.toml"), "--run-dir", str(run_dir), "--quiet"]
    for o in [*BASE, *overrides]:
        args += ["--set", o]
    assert main(args) == 0, sorted((run_dir / "logs").glob("*.log"))
    return json.loads((run_dir / "summary.json").read_text())


@pytest.mark.parametrize("strategy", [
    ["strategy.name=allreduce", "cluster.num_ps=0"],
    ["strategy.name=sync", "cluster.num_ps=1"],
    # bound 1: every replica waits for each round, so the replicas keep in step as the job does
    ["strategy.name=async-allreduce", "cluster.num_ps=0", "strategy.async_bound=1"],
], ids=lambda s: s[0].split("=")[1])
def test_time_split_adds_up_to_the_step(tmp_path, strategy):
    s = run(tmp_path, "job", *strategy)
    assert s["steps"] == STEPS
    step = s["train_seconds"] / s["steps"]
    split = s["time_split_s"]
    per_step = sum(split.values()) / STEPS
    assert LOW * step <= per_step <= HIGH * step, (split, step)
    # the fast worker's wait is communication: the mean over the two workers holds half the delay
    assert split["comm_s"] / STEPS >= DELAY / 4, split
