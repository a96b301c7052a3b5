"""Figures of the job: a global stop in images applied, one job clock, evaluation that
scales and never kills a healthy job, targets that stop every process at one point."""

import json
import math
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from scaletrain.cli import main
from scaletrain.config import load_config
from scaletrain import data
from scaletrain.models import build_model
from scaletrain.replicas import evaluate
from scaletrain.strategies.traits import REGISTRY

from conftest import RECIPES, ROOT

QUIET = ["data.workers=0", "train.eval_every=0", "train.log_every=5"]


def run(tmp_path, name, *overrides):
    """A real run through the command line; its summary, with `outside_s`: the seconds the
    command took as the test saw them."""
    run_dir = tmp_path / name
    t0 = time.perf_counter()
    args = ["train", "--recipe", str(RECIPES / "digits.toml"), "--run-dir", str(run_dir), "--quiet",
            *(["--resume"] if (run_dir / "checkpoints").exists() else [])]
    for o in overrides:
        args += ["--set", o]
    assert main(args) == 0, (run_dir / "logs").exists() and [p.read_text()[-2000:] for p in
                                                             sorted((run_dir / "logs").glob("*.log"))]
    return {**json.loads((run_dir / "summary.json").read_text()), "outside_s": time.perf_counter() - t0}


def cluster(nodes, gpus, ps, strategy, *more):
    return [f"cluster.nodes={nodes}", f"cluster.gpus_per_node={gpus}", f"cluster.num_ps={ps}",
            f"strategy.name={strategy}", *more]


def test_backup_and_mixed_async_leave_the_straggler_behind(tmp_path):
    """3 nodes, node 3 slowed by 0.2 s a step: sync runs at its pace; backup (b=1) and mixed-async
    stop when the job has applied the same images, the straggler with them."""
    slow = [*QUIET, "train.steps=30", "train.warmup_log_steps=0", "strategy.slow_node=2",
            "strategy.slow_delay_s=0.2"]
    sync = run(tmp_path, "sync", *cluster(3, 1, 1, "sync"), *slow)
    backup = run(tmp_path, "backup", *cluster(3, 1, 1, "backup", "strategy.backup_workers=1"), *slow)
    mixed = run(tmp_path, "mixed", *cluster(3, 1, 1, "mixed-async"), *slow)
    target = 30 * 3 * 32
    for s in (sync, backup, mixed):
        assert s["images_applied"] == target and s["steps"] == 30
        assert s["images_computed"] >= target
        # every process stopped at the same point of the job
        assert {w["stopped_at_images"] for w in s["per_worker"]} == {target}
    assert sync["train_seconds"] >= 30 * 0.2  # every update waits for the straggler
    assert backup["dropped_gradients"] > 0 and backup["images_computed"] > target
    assert backup["train_seconds"] < 0.6 * sync["train_seconds"], (backup["train_seconds"], sync["train_seconds"])
    assert mixed["train_seconds"] < 0.6 * sync["train_seconds"], (mixed["train_seconds"], sync["train_seconds"])
    # the fast nodes did the work: the straggler computed far fewer steps
    steps = {w["node"]: w["steps"] for w in backup["per_worker"]}
    assert steps[2] < 0.5 * min(steps[0], steps[1])


@pytest.mark.parametrize("strategy, ps, more", [
    ("allreduce", 0, []), ("sync", 1, []), ("backup", 1, ["strategy.backup_workers=1"]),
    ("mixed-async", 1, []), ("async", 2, [])])
def test_throughput_is_images_applied_over_job_time(tmp_path, strategy, ps, more):
    s = run(tmp_path, strategy, *cluster(2, 2, ps, strategy, *more), *QUIET, "train.steps=24",
            "train.warmup_log_steps=0", "train.log_every=4", "data.batch_size=16")
    target = 24 * 4 * 16
    assert s["images_applied"] == target, s["images_applied"]
    # Async shards: to the last timed window, the one before the job's end (JobClock)
    rows = [json.loads(line) for line in (tmp_path / strategy / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if r["kind"] == "train" and "images_per_sec" in r][-1]
    images, seconds = (last["images"], last["train_wall"]) if REGISTRY[strategy].server == "async" else \
        (target, s["train_seconds"])
    assert s["images_per_sec"] * seconds == pytest.approx(images, rel=0.02)
    assert s["train_seconds"] <= s["wall_seconds"] < s["outside_s"]  # the job clock is inside the command's time
    assert s["images_computed"] >= target


def test_backup_stops_exactly_at_the_target(tmp_path):
    """3 nodes, b = 1: an update applies 2 nodes' batches, the target 7 x 3 of them: the last update
    waits for one gradient only."""
    s = run(tmp_path, "b", *cluster(3, 1, 1, "backup", "strategy.backup_workers=1"), *QUIET, "train.steps=7",
            "data.batch_size=8")
    assert s["images_applied"] == 7 * 3 * 8 and {w["stopped_at_images"] for w in s["per_worker"]} == {168}


def test_an_async_jobs_rate_leaves_out_the_drain_after_its_target(tmp_path):
    """mixed-async with the chief's node slowed: the other pusher reaches the target, and the chief
    learns it at its next exchange, a slowed step later. That last window is not timed: the rate is
    the images of the windows before it over their seconds."""
    s = run(tmp_path, "drain", *cluster(2, 1, 1, "mixed-async", "strategy.slow_node=0", "strategy.slow_delay_s=0.3"),
            "data.workers=0", "train.eval_every=0", "train.log_every=1", "train.warmup_log_steps=0",
            "train.steps=30")
    rows = [json.loads(line) for line in (tmp_path / "drain" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert train[-1]["images"] == s["images_applied"] == 30 * 2 * 32
    assert "images_per_sec" not in train[-1]  # the window that ended the job, drain and all
    timed = [r for r in train if "images_per_sec" in r]
    assert s["timed_windows"] == len(timed) >= 2
    last = timed[-1]  # every window from the start (no warm-up) to this one: their images over their seconds
    assert s["images_per_sec"] == pytest.approx(last["images"] / last["train_wall"], rel=0.02)


def test_long_evaluation_and_slow_steps_do_not_kill_a_healthy_job(tmp_path):
    """timeout_s = 2, while one evaluation of the test set takes over 5 times that, and one node's
    steps take 3 s: nobody waits in a timed call on healthy work (the PS waits in a receive
    meanwhile, the other worker in a barrier)."""
    s = run(tmp_path, "long", *cluster(2, 1, 1, "sync", "cluster.timeout_s=2", "strategy.slow_node=1",
                                       "strategy.slow_delay_s=3"),
            "data.workers=0", "model.name=resnet18", "data.image_size=256", "data.batch_size=4",
            "train.steps=2", "train.eval_every=2")
    assert s["eval_seconds"] > 5 * 2, s["eval_seconds"]  # one evaluation, at the end
    assert s["test_images"] == 359 and s["steps"] == 2
    assert (tmp_path / "long" / "model.safetensors").exists()


def test_slow_steps_do_not_time_out_collectives(tmp_path):
    """timeout_s = 2 and one node's steps take 3 s: the other replica waits in the all-reduce."""
    s = run(tmp_path, "slow", *cluster(2, 1, 0, "allreduce", "cluster.timeout_s=2", "strategy.slow_node=1",
                                       "strategy.slow_delay_s=3"), *QUIET, "train.steps=2")
    assert s["steps"] == 2 and s["train_seconds"] > 3  # the other replica waited out at least one slow step


def test_several_shards_hold_at_every_point_and_resume(tmp_path):
    """async with 2 shards and 2 replicas a node: an evaluation every step and a checkpoint every
    two, so pushers meet shards that reached a point before or after them; then a resume."""
    setup = [*cluster(2, 2, 2, "async"), "data.workers=0", "train.eval_every=1", "train.checkpoint_every=2",
             "train.log_every=1", "data.batch_size=8"]
    s = run(tmp_path, "r", *setup, "train.steps=6")
    assert s["images_applied"] == 6 * 4 * 8 and {w["stopped_at_images"] for w in s["per_worker"]} == {192}
    evals = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in evals if r["kind"] == "eval"] == [1, 2, 3, 4, 5, 6]
    ckpt = torch.load(tmp_path / "r" / "checkpoints" / "ckpt-00000006.pt", weights_only=True)
    assert ckpt["images"] == 192 and [shard["images"] for shard in ckpt["ps"]] == [192, 192]
    r = run(tmp_path, "r", *setup, "train.steps=10")
    assert r["start_step"] == 6 and r["steps"] == 10 and r["images_applied"] == 10 * 4 * 8
    assert r["part_images_applied"] == 4 * 4 * 8  # the resumed part's, which its rates are over
    assert {w["stopped_at_images"] for w in r["per_worker"]} == {320}


def test_evaluation_over_four_replicas_equals_one(tmp_path):
    """Each replica evaluates a quarter of the test set (BatchNorm statistics averaged first);
    the job's figure is that of the saved model evaluated in one process."""
    s = run(tmp_path, "four", *cluster(2, 2, 0, "allreduce"), *QUIET, "train.steps=20")
    cfg = load_config(RECIPES / "digits.toml", ["data.workers=0"])
    model = build_model(cfg.model)
    model.load_state_dict(load_file(str(tmp_path / "four" / "model.safetensors")))
    test_set = data.build_datasets(cfg)[1]
    prepare = data.Prepare([], test_set.stats, torch.device("cpu"))
    one = evaluate(model, data.test_loader(test_set, cfg), torch.device("cpu"), prepare, None, 1)
    assert s["test_accuracy"] == one["test_accuracy"]
    assert s["test_loss"] == pytest.approx(one["test_loss"], rel=1e-5)
    # and the slices were really split: a quarter of the set each, together all of it
    slices = [[i for b in data.test_loader(test_set, cfg, rank=r, world=4).batch_sampler for i, _ in b]
              for r in range(4)]
    assert [len(x) for x in slices] == [90, 90, 90, 89] and sorted(sum(slices, [])) == list(range(359))


@pytest.mark.parametrize("strategy, nodes, gpus", [("sync", 2, 1), ("mixed-async", 2, 1), ("mixed-async", 1, 2)])
def test_target_accuracy_stops_every_process_at_one_point(tmp_path, strategy, nodes, gpus):
    """With a node of 2 replicas under mixed-async, the chief's node-mate learns of the target with it
    (only the chief evaluates there), else it waits for the chief in the next backward for ever."""
    s = run(tmp_path, strategy, *cluster(nodes, gpus, 1, strategy), "data.workers=0", "train.steps=400",
            "train.eval_every=10", "train.target_accuracy=0.5")
    assert s["target_reached"] and s["test_accuracy"] >= 0.5
    assert s["steps"] < 400 and s["steps_to_target"] == s["steps"] and s["steps"] % 10 == 0
    assert {w["stopped_at_images"] for w in s["per_worker"]} == {s["images_to_target"]}
    assert 0 < s["time_to_target"] <= s["train_seconds"]
    rows = [json.loads(line) for line in (tmp_path / strategy / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if r["kind"] == "eval"]
    assert evals[-1]["step"] == s["steps"] and all(r["test_accuracy"] < 0.5 for r in evals[:-1])
    ckpt = sorted((tmp_path / strategy / "checkpoints").glob("ckpt-*.pt"))[-1]
    assert ckpt.name == f"ckpt-{s['steps']:08d}.pt"


def test_target_loss_needs_evaluations(tmp_path, capsys):
    args = ["train", "--recipe", str(RECIPES / "digits.toml"), "--run-dir", str(tmp_path / "r"),
            "--set", "train.target_loss=0.5", "--set", "train.eval_every=0"]
    assert main(args) == 2
    assert "set train.eval_every > 0" in capsys.readouterr().err


def test_heartbeats_compare_no_clocks(monkeypatch):
    """A peer is missing when its counter stands still on the reader's own clock, whatever the
    writers' clocks say."""
    import datetime

    import torch.distributed as dist

    from scaletrain.comm import liveness
    from scaletrain.comm.groups import Context
    from scaletrain.config import ClusterConfig
    from scaletrain.plan import make_plan

    store = dist.TCPStore("127.0.0.1", 0, 1, True, datetime.timedelta(seconds=5), wait_for_workers=False)
    plan = make_plan(ClusterConfig(nodes=3), ps_required=False)
    now = [1000.0]
    monkeypatch.setattr(liveness.time, "monotonic", lambda: now[0])
    live = liveness._Liveness(Context(plan, plan.procs[0]))
    for r in range(3):
        store.add(f"hb/{r}", 1)  # every rank joined (liveness.join)
    read = lambda: store.multi_get(live.keys)  # noqa: E731 - the heartbeat's one read of every counter
    assert live.missing(store, read()) == []
    now[0] += liveness.STALE_S + 1
    store.add("hb/1", 1)  # rank 1 beats, rank 2 does not
    assert live.missing(store, read()) == [2]
    store.set("done/2", "1")  # a rank that finished cleanly is not missing
    now[0] += liveness.STALE_S + 1
    store.add("hb/1", 1)
    assert live.missing(store, read()) == []


def test_learning_rate_scales_with_the_images_per_update():
    from scaletrain.config import OptimConfig
    from scaletrain.optim import lr_at
    from scaletrain.strategies import images_per_update

    lin = OptimConfig(lr=0.1, scale_lr="linear", reference_batch=32, warmup_steps=4)
    assert [lr_at(lin, s, 100, 128) for s in range(5)] == pytest.approx([0.1, 0.175, 0.25, 0.325, 0.4])
    # scaled down (fewer images per update than the reference): warm-up rises from 0, never downhill
    assert [lr_at(lin, s, 100, 16) for s in range(5)] == pytest.approx([0.0125, 0.025, 0.0375, 0.05, 0.05])
    sq = OptimConfig(lr=0.1, scale_lr="sqrt", reference_batch=32)
    assert lr_at(sq, 50, 100, 128) == pytest.approx(0.2)
    assert lr_at(OptimConfig(lr=0.1, reference_batch=32), 50, 100, 128) == pytest.approx(0.1)  # none

    def per_update(*sets):
        return images_per_update(load_config(None, ["data.batch_size=32", *sets]))

    assert per_update(*cluster(4, 2, 0, "allreduce")) == 256
    assert per_update(*cluster(4, 2, 1, "sync")) == 256
    assert per_update(*cluster(4, 2, 1, "backup", "strategy.backup_workers=1")) == 192
    assert per_update(*cluster(4, 2, 1, "mixed-async")) == 64
    assert per_update(*cluster(4, 2, 1, "async")) == 32
    assert math.isclose(per_update(), 32)


# A loop of one's own under allreduce (2 processes): torch's zero_grad() drops the gradients by default
# (set_to_none=True), which would leave DDP's bucket views every step (a fresh allocation per parameter
# in each backward and a copy into its bucket). The hook sees where autograd accumulated each gradient.
VIEWS = """
import json, sys
import scaletrain

cfg = scaletrain.load_config(sys.argv[1], ["cluster.gpus_per_node=2", "train.steps=6", "data.workers=0",
                                           "train.eval_every=0", "train.threads=1", "cluster.timeout_s=30"])
with scaletrain.Job.from_env(cfg, run_dir=sys.argv[2]) as job:
    model, optimizer = job.wrap(scaletrain.build_model(cfg.model))
    params, accumulated, zeroed, into = list(model.parameters()), {}, [], []
    for i, p in enumerate(params):
        p.register_post_accumulate_grad_hook(lambda p, i=i: accumulated.__setitem__(i, p.grad.data_ptr()))
    for x, y in job.batches():
        optimizer.zero_grad()  # torch's default, as a loop writes it
        zeroed.append([None if p.grad is None else p.grad.data_ptr() for p in params])
        loss = job.loss(model(x), y)
        loss.backward()
        into.append([accumulated[i] for i in range(len(params))])
        job.step(loss)
    with open(f"{sys.argv[2]}/views{job.ctx.me.index}.json", "w") as f:
        json.dump({"zeroed": zeroed, "into": into, "views": [p.grad.data_ptr() for p in params]}, f)
"""


def test_a_loops_plain_zero_grad_keeps_the_gradients_in_ddps_buckets(tmp_path):
    path, run_dir = tmp_path / "views.py", tmp_path / "run"
    path.write_text(VIEWS)
    r = subprocess.run([sys.executable, str(path), str(RECIPES / "digits.toml"), str(run_dir)], cwd=ROOT,
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-2000:]
    for index in (0, 1):
        seen = json.loads((run_dir / f"views{index}.json").read_text())
        # DDP moves its buckets once, after the first backward (in the order the gradients came): from the
        # third step on every gradient is its bucket's view, zeroed in place and accumulated into
        assert all(step == seen["views"] for step in seen["zeroed"][2:]), (index, seen["zeroed"])
        assert all(step == seen["views"] for step in seen["into"][2:]), (index, seen["into"])
