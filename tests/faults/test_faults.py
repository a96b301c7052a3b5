"""Faults injected for real into real jobs: stop signals, kill -9, SIGSTOP, a killed launcher.

Each test asserts the outcome, the time it took, the message, what was lost, and that no
process of the job is left behind.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from conftest import ROOT, free_port, scaletrain_cmd
from test_failure import alive

TIMEOUT_S = 5
BASE = ["data.workers=0", "cluster.nodes=2", f"cluster.timeout_s={TIMEOUT_S}", "train.steps=60",
        "train.log_every=5", "train.eval_every=0", "train.checkpoint_every=20", "train.deterministic=true"]


def cmd(run_dir, *sets):
    args = ["train", "--recipe", "recipes/digits.toml", "--run-dir", str(run_dir), "--quiet"]
    for s in (*BASE, *sets):
        args += ["--set", s]
    return scaletrain_cmd(*args)


def start(run_dir, env, *sets):
    return subprocess.Popen(cmd(run_dir, *sets), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def pids(run_dir):
    logs = run_dir / "logs"
    return {int(f.stem[4:]): json.loads(f.read_text())["pid"] for f in logs.glob("rank*.json")} \
        if logs.exists() else {}


def wait_training(p, run_dir, world, rows=3):
    """Until every process is up and the chief has logged `rows` train rows."""
    deadline = time.time() + 120
    while time.time() < deadline:
        metrics = run_dir / "metrics.jsonl"
        if len(pids(run_dir)) == world and metrics.exists() and \
                sum('"train"' in r for r in metrics.read_text().splitlines()) >= rows:
            return pids(run_dir)
        assert p.poll() is None, p.communicate()
        time.sleep(0.2)
    raise AssertionError("the job did not start")


def no_orphans(procs):
    deadline = time.time() + 5
    while any(alive(pid) for pid in procs.values()) and time.time() < deadline:
        time.sleep(0.1)
    assert not [r for r, pid in procs.items() if alive(pid)], "processes left behind"


def weights(run_dir):
    return load_file(str(run_dir / "model.safetensors"))


def same_weights(a, b):
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    return all(bool((wa[k] == wb[k]).all()) for k in wa)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Uninterrupted runs of the configurations the fault tests interrupt."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = {}
    for name, sets in {"allreduce": ["strategy.name=allreduce"],
                       "sync": ["strategy.name=sync", "cluster.num_ps=1"]}.items():
        run_dir = tmp_path_factory.mktemp("reference") / name
        r = subprocess.run(cmd(run_dir, *sets), cwd=ROOT, env=env, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        out[name] = run_dir
    return out


def test_sigterm_to_the_launcher_checkpoints_stops_and_resumes_exactly(tmp_path, env, reference):
    run_dir = tmp_path / "run"
    p = start(run_dir, env, "strategy.name=allreduce")
    procs = wait_training(p, run_dir, 2)
    t0 = time.time()
    p.send_signal(signal.SIGTERM)  # what Slurm sends at a time limit or preemption
    _, err = p.communicate(timeout=60)
    elapsed = time.time() - t0
    assert p.returncode == 75, err
    no_orphans(procs)
    steps = sorted(int(f.stem[5:]) for f in (run_dir / "checkpoints").glob("ckpt-*.pt"))
    assert steps and steps[-1] < 60, steps
    assert f"stopped at step {steps[-1]}" in err and "SIGTERM" in err, err
    assert not (run_dir / "model.safetensors").exists()  # the run is not over
    assert elapsed < 10, elapsed
    # Run again: it continues from that checkpoint and ends where an uninterrupted run does.
    r = subprocess.run(cmd(run_dir, "strategy.name=allreduce") + ["--resume"], cwd=ROOT, env=env,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert json.loads((run_dir / "summary.json").read_text())["start_step"] == steps[-1]
    assert same_weights(run_dir, reference["allreduce"])


def test_a_stop_signal_to_one_worker_stops_every_process_at_one_step(tmp_path, env):
    run_dir = tmp_path / "run"
    p = start(run_dir, env, "strategy.name=sync", "cluster.num_ps=1", "train.steps=100000")
    procs = wait_training(p, run_dir, 3)
    os.kill(procs[1], signal.SIGUSR1)  # worker 1 alone: the request travels to the others
    _, err = p.communicate(timeout=60)
    assert p.returncode == 75, err
    no_orphans(procs)
    step = int(sorted((run_dir / "checkpoints").glob("ckpt-*.pt"))[-1].stem[5:])
    for r in (1, 2):  # every process stopped at the same step, by the same signal
        assert f"stopped by SIGUSR1 at step {step}" in (run_dir / "logs" / f"rank{r}.log").read_text()


def test_stop_signals_repeated_to_the_end_kill_no_process_on_its_way_out(tmp_path, env):
    """A stop signal can come more than once: one that arrives after a process's checkpoint, during its
    last barrier, must not kill it."""
    run_dir = tmp_path / "run"
    p = start(run_dir, env, "strategy.name=allreduce", "train.steps=100000")
    procs = wait_training(p, run_dir, 2)
    while p.poll() is None:
        for pid in procs.values():
            try:
                os.kill(pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
        time.sleep(0.01)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 75, err
    no_orphans(procs)
    step = int(sorted((run_dir / "checkpoints").glob("ckpt-*.pt"))[-1].stem[5:])
    assert f"stopped at step {step}" in err and "SIGUSR1" in err, err  # the chief's own words
    assert f"stopped by SIGUSR1 at step {step}" in (run_dir / "logs" / "rank1.log").read_text()


def test_a_killed_launcher_takes_its_processes_with_it(tmp_path, env):
    run_dir = tmp_path / "run"
    p = start(run_dir, env, "strategy.name=sync", "cluster.num_ps=1", "train.steps=100000")
    procs = wait_training(p, run_dir, 3)
    p.kill()
    p.wait()
    no_orphans(procs)


def descendants(pid):
    """Every process below pid, from /proc's parent links."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        kids = parents.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def test_loader_processes_die_with_a_killed_launcher(tmp_path, env):
    """data.workers = 2: a training process's loader processes are its children, which the
    kernel's parent-death signal of the launcher does not reach; they die with it (within a second)
    rather than when they next look for their parent (every 5 s)."""
    run_dir = tmp_path / "run"
    p = start(run_dir, env, "strategy.name=allreduce", "data.workers=2", "train.steps=100000")
    procs = wait_training(p, run_dir, 2)
    tree = descendants(p.pid)
    assert len(tree) >= 2 + 2 * 2, tree  # 2 training processes, 2 loader processes each
    p.kill()
    p.wait()
    t0 = time.time()
    while any(alive(pid) for pid in tree) and time.time() - t0 < 10:
        time.sleep(0.05)
    assert not [pid for pid in tree if alive(pid)], "processes left behind"
    assert time.time() - t0 < 2, time.time() - t0
    no_orphans(procs)


def test_max_restarts_finishes_a_sync_job_whose_worker_was_killed(tmp_path, env, reference):
    run_dir = tmp_path / "run"
    p = start(run_dir, env, "strategy.name=sync", "cluster.num_ps=1", "cluster.max_restarts=2")
    procs = wait_training(p, run_dir, 3, rows=6)  # past the first checkpoint (step 20)
    os.kill(procs[1], signal.SIGKILL)
    _, err = p.communicate(timeout=180)
    assert p.returncode == 0, err
    no_orphans(procs)
    line = next(l for l in err.splitlines() if "restart 1 of 2" in l)
    assert "rank 1 (worker 1 on node 2) was killed by signal SIGKILL" in line, err
    assert "resuming from the checkpoint of step" in line and "steps lost" in line, line
    assert "restart 2" not in err
    assert same_weights(run_dir, reference["sync"])


def test_a_frozen_worker_is_named_and_the_job_ends_within_the_bound(tmp_path, env):
    run_dir = tmp_path / "run"
    p = start(run_dir, env, "strategy.name=allreduce", "train.steps=100000")
    procs = wait_training(p, run_dir, 2)
    os.kill(procs[1], signal.SIGSTOP)
    t0 = time.time()
    _, err = p.communicate(timeout=60)
    elapsed = time.time() - t0
    assert p.returncode == 1, err
    assert elapsed <= TIMEOUT_S + 10, elapsed
    assert "rank 1 (worker 1 on node 2) stopped answering" in err.splitlines()[-1], err
    no_orphans(procs)


def test_a_frozen_ps_is_named_not_the_workers_that_left_because_of_it(tmp_path, env):
    """The workers leave naming the PS; the chief stays a moment (it serves the store) and is killed
    by the launcher meanwhile: that kill is the launcher's doing, not the chief's failure."""
    run_dir = tmp_path / "run"
    p = start(run_dir, env, "strategy.name=sync", "cluster.num_ps=1", "train.steps=100000")
    procs = wait_training(p, run_dir, 3)
    os.kill(procs[2], signal.SIGSTOP)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 1, err
    assert "rank 2 (ps 0 on node 2) stopped answering" in err.splitlines()[-1], err
    no_orphans(procs)


def test_a_frozen_worker_of_three_nodes_is_named_and_its_node_left_out(tmp_path, env):
    run_dir = tmp_path / "run"
    p = start(run_dir, env, "strategy.name=allreduce", "cluster.nodes=3", "cluster.min_nodes=2",
              "cluster.max_restarts=1")
    procs = wait_training(p, run_dir, 3, rows=6)  # past the first checkpoint (step 20)
    os.kill(procs[1], signal.SIGSTOP)
    _, err = p.communicate(timeout=180)
    assert p.returncode == 0, err
    line = next(x for x in err.splitlines() if "restart 1 of 1" in x)
    assert line.startswith("scaletrain: rank 1 (worker 1 on node 2) stopped answering (frozen or hung) and was "
                           "killed; restart 1 of 1 without node 2 "), line
    assert json.loads((run_dir / "summary.json").read_text())["nodes"] == 2
    no_orphans(procs)


def test_a_worker_failing_at_start_ends_a_ps_job_within_seconds(tmp_path, env):
    run_dir = tmp_path / "run"
    t0 = time.time()
    # Fewer images than a global batch: every worker fails once it has its data set; the PS waits for them.
    r = subprocess.run(cmd(run_dir, "strategy.name=sync", "cluster.num_ps=1", "cluster.timeout_s=60",
                           "data.name=synthetic", "data.synthetic_size=8"),
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    elapsed = time.time() - t0
    assert r.returncode == 1, r.stderr
    assert elapsed < 30, (elapsed, r.stderr)
    assert "8 training images are fewer than one global batch" in r.stderr, r.stderr
    assert list(run_dir.glob("logs/rank*.json")), "the processes were started"


@pytest.mark.parametrize("strategy", ["allreduce", "sync"])
def test_timed_checkpoints_are_taken_at_steps_every_process_agrees_on(tmp_path, env, strategy):
    run_dir = tmp_path / "run"
    r = subprocess.run(cmd(run_dir, f"strategy.name={strategy}", f"cluster.num_ps={int(strategy == 'sync')}",
                           "train.steps=200", "train.checkpoint_every=0", "train.checkpoint_every_s=1",
                           "train.keep_checkpoints=100"),
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    steps = sorted(int(f.stem[5:]) for f in (run_dir / "checkpoints").glob("ckpt-*.pt"))
    wall = [json.loads(line)["wall"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if '"train"' in line][-1]
    # About one a second of the job, the final one at step 200. Each comes at the first sync point
    # 1 s after the previous one was saved: saving and reaching that step stretch the gaps on a loaded
    # machine (to 1.3 s here), so at least one every 2 s.
    assert steps[-1] == 200 and len(steps) - 1 >= int(wall / 2) >= 1, (steps, wall)


def role_pid(run_dir, role, index):
    logs = [json.loads(f.read_text()) for f in (run_dir / "logs").glob("rank*.json")]
    return next((d["rank"], d["pid"]) for d in logs if d["role"] == role and d["index"] == index)


@pytest.mark.parametrize("strategy", ["mixed-async", "async", "backup"])
def test_an_asynchronous_job_goes_on_without_a_lost_worker_node(tmp_path, env, strategy):
    run_dir = tmp_path / "run"
    # Steps of an emulated 0.1 s: the two nodes left need about 13 s for the rest of the target,
    # longer than noticing the loss takes (TIMEOUT_S), however fast this host moves the gradients.
    sets = [f"strategy.name={strategy}", "cluster.nodes=3", "cluster.num_ps=1", "train.steps=100",
            "strategy.backup_workers=1", "train.emulate_compute_s=0.1"]
    p = start(run_dir, env, *sets)
    procs = wait_training(p, run_dir, 4)
    rank, pid = role_pid(run_dir, "worker", 2)  # node 3's worker; the PS lives on node 2
    os.kill(pid, signal.SIGKILL)
    t0 = time.time()
    while not (run_dir / "logs" / "dropped").exists() and p.poll() is None:
        time.sleep(0.1)
    detected = time.time() - t0
    _, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    assert detected <= TIMEOUT_S + 10, detected
    assert f"rank {rank} (worker 2 on node 3) was killed by signal SIGKILL" in err, err
    assert "the job goes on without node 3" in err, err
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["images_applied"] == 100 * 3 * 32  # the job's target, reached by the other two
    (lost,) = s["lost_workers"]
    assert lost["nodes"] == [3] and lost["ranks"] == [rank], lost  # node 3, as the message says
    assert 0 < lost["images"] < s["images_applied"] and 0 < lost["wall"] < s["wall_seconds"], lost
    assert [w["node"] for w in s["per_worker"]] == [0, 1]
    no_orphans(procs)


@pytest.mark.parametrize("strategy,sig", [("allreduce", signal.SIGKILL), ("allreduce", signal.SIGSTOP),
                                          ("sync", signal.SIGKILL), ("async-allreduce", signal.SIGKILL)])
def test_with_survive_loss_a_job_goes_on_in_place_without_a_lost_worker(tmp_path, env, strategy, sig):
    """cluster.survive_loss, no restarts: all-reduce's ring re-forms among the survivors, sync's shard waits for
    the pushers left. The learning rate follows the survivors' batch (linear rule: 2/3 of it). Asynchronous
    all-reduce's rounds go on over the ring, and its replicas end holding one model."""
    run_dir = tmp_path / "run"
    p = start(run_dir, env, f"strategy.name={strategy}", "cluster.nodes=3", f"cluster.num_ps={int(strategy == 'sync')}",
              "cluster.survive_loss=true", "cluster.max_restarts=0", "train.steps=60", "train.emulate_compute_s=0.1",
              "train.checkpoint_every=0", "optim.scale_lr=linear", "optim.warmup_steps=0",
              "optim.schedule=constant")
    procs = wait_training(p, run_dir, 3 + (strategy == "sync"))
    rank, pid = role_pid(run_dir, "worker", 2)  # node 3's worker; sync's PS lives on node 2
    os.kill(pid, sig)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    # A killed process is dropped as soon as the launcher saw it end; a frozen one once silent for the timeout
    what = "sent no heartbeat for 5 s" if sig == signal.SIGSTOP else "ended (its launcher saw it exit)"
    assert f"rank {rank} (worker 2 on node 3) {what}; the job goes on without node 3" in err, err
    s = json.loads((run_dir / "summary.json").read_text())
    (lost,) = s["lost_workers"]
    print(lost)
    assert lost["nodes"] == [3] and lost["detect_s"] <= (TIMEOUT_S + 3 + 1 if sig == signal.SIGSTOP else 1.5), lost
    assert s["images_applied"] >= 60 * 3 * 32 and [w["node"] for w in s["per_worker"]] == [0, 1], s
    if strategy == "allreduce":
        assert lost["steps_lost"] <= 1 and lost["heal_s"] < 5, lost
        rows = [json.loads(r) for r in (run_dir / "metrics.jsonl").read_text().splitlines() if '"train"' in r]
        assert {r["lr"] for r in rows if r["images"] < lost["images"] - 96} == {0.05 * 96 / 256}, rows
        assert {round(r["lr"], 9) for r in rows if r["images"] > lost["images"]} == {round(0.05 * 64 / 256, 9)}
    if strategy == "async-allreduce":
        assert "heal_s" in lost and len({w["weights_sum"] for w in s["per_worker"]}) == 1, (lost, s["per_worker"])
    no_orphans(procs)


def test_with_keep_batch_the_replicas_left_accumulate_more_and_the_global_batch_stays(tmp_path, env):
    """cluster.after_loss = keep-batch: 3 replicas of 2 micro-batches lose one; the two left take 3 each, so an
    update stays 192 images and the learning rate the recipe's."""
    run_dir = tmp_path / "run"
    p = start(run_dir, env, "strategy.name=allreduce", "cluster.nodes=3", "cluster.survive_loss=true",
              "cluster.after_loss=keep-batch", "train.grad_accum_steps=2", "cluster.max_restarts=0", "train.steps=40",
              "train.emulate_compute_s=0.05", "train.checkpoint_every=0", "optim.scale_lr=linear",
              "optim.warmup_steps=0", "optim.schedule=constant")
    procs = wait_training(p, run_dir, 3)
    rank, pid = role_pid(run_dir, "worker", 2)
    os.kill(pid, signal.SIGKILL)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    s = json.loads((run_dir / "summary.json").read_text())
    (lost,) = s["lost_workers"]
    rows = [json.loads(r) for r in (run_dir / "metrics.jsonl").read_text().splitlines() if '"train"' in r]
    assert {r["lr"] for r in rows} == {0.05 * 192 / 256}, rows  # the recipe's batch, the recipe's rate
    steps = [b["images"] - a["images"] for a, b in zip(rows, rows[1:])]
    # Rows about 5 updates apart, each of 192 images before the loss and after; the one under way when it came was
    # redone by the two with their 2 micro-batches (128 images)
    assert sorted(d % 192 for d in steps) == [0] * (len(steps) - 1) + [128], steps
    assert rows[-1]["images"] > lost["images"] + 960, (rows, lost)
    assert "2 replicas, 3 micro-batches of 32 each: a global batch of 192 images, the recipe's" in out + err, out
    assert s["images_applied"] >= 40 * 192
    no_orphans(procs)


def test_a_replacement_joins_in_place_of_a_killed_worker_with_a_live_replicas_state(tmp_path, env):
    """cluster.replacements: the launcher starts a replacement for the dropped worker, which joins at a step
    boundary with the chief's weights, optimizer and progress (tests/dist/test_ring.py checks them bit for
    bit); the job ends with all three nodes, no checkpoint read, no restart."""
    run_dir = tmp_path / "run"
    p = start(run_dir, env, "strategy.name=allreduce", "cluster.nodes=3", "cluster.survive_loss=true",
              "cluster.replacements=1", "cluster.max_restarts=0", "train.steps=150", "train.emulate_compute_s=0.1",
              "train.checkpoint_every=10")  # sync points, where the ring's other collective (agree_stop) runs
    procs = wait_training(p, run_dir, 3)
    rank, pid = role_pid(run_dir, "worker", 2)
    os.kill(pid, signal.SIGKILL)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    assert f"started a replacement for rank {rank} (worker 2 on node 3) (1/1)" in err, err
    s = json.loads((run_dir / "summary.json").read_text())
    (lost,), (joined,) = s["lost_workers"], s["joined_workers"]
    print(lost, joined)
    assert joined["nodes"] == [3] and joined["ranks"] == [rank] and joined["images"] > lost["images"], joined
    assert 0 < joined["wait_s"] < 30 and 0 < joined["adopt_s"] < 5 and joined["pause_s"] < 5, joined
    assert s["resumed_from"] is None and s["images_applied"] >= 150 * 3 * 32, s
    assert [w["node"] for w in s["per_worker"]] == [0, 1, 2], s["per_worker"]  # the replacement reported too
    replacement = (run_dir / "logs" / f"rank{rank}.1.log")
    assert replacement.exists() and (run_dir / "logs" / f"rank{rank}.log").exists()  # the lost one's log kept
    no_orphans(procs)


@pytest.mark.parametrize("replace", [1, 0])
def test_under_torchrun_a_killed_worker_is_replaced_on_its_node_and_joins_with_a_live_replicas_state(tmp_path, env,
                                                                                                     replace):
    """survive_loss under torchrun: the process each agent started keeps its rank (launch/keep.py). The worker of
    node 3 killed -9, its keeper starts a replacement once the chief has dropped it (cluster.replacements); it
    joins the running job through the agent's store. Every agent ends with status 0, none restarted; without a
    replacement too (an agent that failed would hold the others at torchrun's exit barrier)."""
    run_dir = tmp_path / "run"
    sets = [*BASE, "strategy.name=allreduce", "cluster.nodes=3", "cluster.survive_loss=true",
            f"cluster.replacements={replace}", "cluster.max_restarts=0", "train.steps=150",
            "train.emulate_compute_s=0.1", "train.checkpoint_every=10", f"cluster.master_port={free_port()}"]
    plan = subprocess.run(scaletrain_cmd("plan", "--recipe", "recipes/digits.toml", "--format", "torchrun",
                                         "--run-dir", str(run_dir), *(a for x in sets for a in ("--set", x))),
                          cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    commands = [c for c in plan.stdout.splitlines() if c.startswith("torchrun ")]
    env = dict(env, PATH=f"{os.path.dirname(sys.executable)}:{env['PATH']}")
    agents = [subprocess.Popen(c, shell=True, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True) for c in commands]
    try:
        wait_training(agents[0], run_dir, 3)
        rank, pid = role_pid(run_dir, "worker", 2)
        os.kill(pid, signal.SIGKILL)
        outs = [a.communicate(timeout=180)[0] for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                os.killpg(a.pid, signal.SIGKILL)
    assert [a.returncode for a in agents] == [0, 0, 0], outs
    killed = f"rank {rank} (worker 2 on node 3) was killed by signal SIGKILL; "
    assert killed + ("started a replacement on this node (1/1)" if replace else "the job goes on without it") \
        in outs[2], outs[2]
    s = json.loads((run_dir / "summary.json").read_text())
    (lost,) = s["lost_workers"]
    assert lost["nodes"] == [3] and lost["steps_lost"] <= 1, lost
    assert s["resumed_from"] is None and s["images_applied"] >= 150 * 3 * 32, s
    ends = s["per_worker"]
    assert [w["node"] for w in ends] == [0, 1, 2][:2 + replace] and len({w["weights_sum"] for w in ends}) == 1, ends
    if replace:
        (joined,) = s["joined_workers"]
        assert joined["nodes"] == [3] and joined["ranks"] == [rank] and joined["images"] > lost["images"], joined
    assert json.loads((run_dir / "logs" / f"rank{rank}.json").read_text())["launcher"] == "torchrun"


@pytest.mark.parametrize("strategy,replace,every,points", [("local-sgd", 0, 4, 10), ("diloco", 1, 8, 0)])
def test_local_steps_go_on_without_a_killed_replica_and_take_in_its_replacement(tmp_path, env, strategy, replace,
                                                                                every, points):
    """local-sgd and diloco with survive_loss: the two left meet over the ring and reach the target (with sync
    points every 10 steps, where the ring's other collective runs); with a replacement it joins with the anchor,
    the outer momentum and the progress of a live replica, so every replica ends the job holding the same
    weights, bit for bit (the last meeting averages changes from each one's own anchor: one anchor apart,
    they would end apart; without sync points, where a join waits out a checkpoint, it joins between meetings
    7 times in 8)."""
    run_dir = tmp_path / "run"
    p = start(run_dir, env, f"strategy.name={strategy}", f"strategy.sync_every={every}", "cluster.nodes=3",
              "cluster.survive_loss=true", f"cluster.replacements={replace}", "cluster.max_restarts=0",
              "train.steps=120", "train.emulate_compute_s=0.1", f"train.checkpoint_every={points}")
    procs = wait_training(p, run_dir, 3)
    rank, pid = role_pid(run_dir, "worker", 2)
    os.kill(pid, signal.SIGKILL)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    assert "the job goes on without node 3" in err, err
    s = json.loads((run_dir / "summary.json").read_text())
    (lost,) = s["lost_workers"]
    print(lost, s.get("joined_workers"), s["per_worker"])
    assert lost["nodes"] == [3] and lost["steps_lost"] <= 1 and lost["heal_s"] < 5, lost
    assert s["images_applied"] >= 120 * 3 * 32, s
    ends = s["per_worker"]
    assert [w["node"] for w in ends] == ([0, 1, 2] if replace else [0, 1]), ends
    assert len({w["weights_sum"] for w in ends}) == 1, ends
    if replace:
        (joined,) = s["joined_workers"]
        assert joined["ranks"] == [rank] and joined["images"] > lost["images"], joined
    no_orphans(procs)


@pytest.mark.parametrize("strategy", ["sync", "mixed-async"])
def test_a_killed_ps_shard_is_taken_on_by_another_and_the_job_goes_on(tmp_path, env, strategy):
    """cluster.survive_loss with two PS shards, no restarts: shard 1 killed, shard 0 takes it on from the
    newest values a pusher holds and the optimizer state of the last checkpoint; every worker reaches the
    target at the images the shards count. Under sync, where without momentum an update's values depend only
    on the values before it (an emulated GPU's gradient is fixed), the job ends with the failure-free job's
    weights, bit for bit: no update's values were lost."""
    sets = [f"strategy.name={strategy}", "cluster.nodes=3", "cluster.num_ps=2", "cluster.survive_loss=true",
            "cluster.max_restarts=0", "train.steps=100", "train.emulate_compute_s=0.1", "train.checkpoint_every=10",
            *(["optim.momentum=0"] if strategy == "sync" else [])]
    if strategy == "sync":
        reference = tmp_path / "reference"
        subprocess.run(cmd(reference, *sets), cwd=ROOT, env=env, check=True, capture_output=True)
        expected = json.loads((reference / "summary.json").read_text())["per_worker"][0]["weights_sum"]
    run_dir = tmp_path / "run"
    p = start(run_dir, env, *sets)
    procs = wait_training(p, run_dir, 5, rows=5)  # step 25: 5 steps after the last checkpoint
    rank, pid = role_pid(run_dir, "ps", 1)
    os.kill(pid, signal.SIGKILL)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    assert f"rank {rank} (ps 1 on node 3) was killed by signal SIGKILL; the job may go on without it" in err, err
    assert f"rank {rank} (ps 1 on node 3) ended (its launcher saw it exit); the job goes on with PS shard 1 taken " \
           "on by another" in err, err
    s = json.loads((run_dir / "summary.json").read_text())
    (lost,) = s["lost_workers"]
    print(lost)
    ps0 = role_pid(run_dir, "ps", 0)[0]
    assert lost["ranks"] == [rank] and lost["shard"] == 1 and lost["taken_on_by"] == ps0, lost
    assert lost["detect_s"] <= 1.5 and lost["heal_s"] < 10, lost
    # the optimizer state's updates since the checkpoint it was rebuilt from: none without momentum (sync here);
    # mixed-async's momentum: a checkpoint every 10 steps, 3 updates a step (one a node)
    assert lost["updates_lost"] == 0 if strategy == "sync" else 0 < lost["updates_lost"] < 33, lost
    assert s["images_applied"] == 100 * 3 * 32, s
    ends = s["per_worker"]
    assert [w["node"] for w in ends] == [0, 1, 2] and {w["stopped_at_images"] for w in ends} == {9600}, ends
    if strategy == "sync":
        assert {w["weights_sum"] for w in ends} == {expected}, (ends, expected)
    assert "took on lost shard 1" in (run_dir / "logs" / f"rank{ps0}.log").read_text()
    no_orphans(procs)


def test_a_frozen_worker_of_an_asynchronous_job_is_dropped_and_killed(tmp_path, env):
    run_dir = tmp_path / "run"
    p = start(run_dir, env, "strategy.name=async", "cluster.nodes=3", "cluster.num_ps=1", "train.steps=100")
    procs = wait_training(p, run_dir, 4)
    _, pid = role_pid(run_dir, "worker", 1)
    os.kill(pid, signal.SIGSTOP)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    assert "(worker 1 on node 2) sent no heartbeat for 5 s; the job goes on without node 2" in err, err
    assert json.loads((run_dir / "summary.json").read_text())["lost_workers"][0]["nodes"] == [2]
    no_orphans(procs)


def test_losing_the_chief_still_ends_an_asynchronous_job_naming_it(tmp_path, env):
    run_dir = tmp_path / "run"
    p = start(run_dir, env, "strategy.name=async", "cluster.nodes=3", "cluster.num_ps=1", "train.steps=100000")
    procs = wait_training(p, run_dir, 4)
    os.kill(procs[0], signal.SIGKILL)
    t0 = time.time()
    _, err = p.communicate(timeout=60)
    assert p.returncode == 1, err
    assert time.time() - t0 <= TIMEOUT_S + 10
    assert "rank 0 (worker 0 on node 1) was killed by signal SIGKILL" in err.splitlines()[-1], err
    no_orphans(procs)


def test_a_restart_leaves_the_failed_node_out_when_min_nodes_allows(tmp_path, env):
    run_dir = tmp_path / "run"
    p = start(run_dir, env, "strategy.name=allreduce", "cluster.nodes=3", "cluster.min_nodes=2",
              "cluster.max_restarts=1")
    procs = wait_training(p, run_dir, 3, rows=6)  # past the first checkpoint (step 20)
    os.kill(procs[2], signal.SIGKILL)
    _, err = p.communicate(timeout=180)
    assert p.returncode == 0, err
    line = next(x for x in err.splitlines() if "restart 1 of 1" in x)
    assert "rank 2 (worker 2 on node 3) was killed by signal SIGKILL; restart 1 of 1 without node 3 " \
           "(2 worker nodes, cluster.min_nodes = 2): resuming from the checkpoint of step" in line, line
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["nodes"] == 2 and s["replicas"] == 2
    rows = [json.loads(r) for r in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["images"] == 60 * 3 * 32 and s["steps"] == 90  # the job's target, in images, is kept
    # Each line names the step the run resumes from as the 2-node job counts it (3 of its steps are 2 of 3 nodes')
    resumed = s["start_step"]
    saved = resumed * 2 // 3
    assert f"checkpoint of step {saved}, which is step {resumed} with 2 worker nodes" in line, (line, resumed)
    assert f"resumed from {run_dir}/checkpoints/ckpt-{saved:08d}.pt at step {resumed} " in err, err
    assert s["lost_workers"] == [{"nodes": [3], "ranks": [2], "host": None, "restart": 1,
                                  "images": resumed * 2 * 32, "step": resumed}], s["lost_workers"]
    no_orphans(procs)


def test_sigterm_during_start_up_is_a_stop_and_leaves_no_process(tmp_path, env):
    """A stop signal forwarded while the processes still import torch or meet at the rendezvous:
    they hold it until they can act on it, instead of dying of it (which the launcher took for a
    failure)."""
    run_dir = tmp_path / "run"
    p = start(run_dir, env, "strategy.name=allreduce")
    deadline = time.time() + 60
    while not (run_dir / "logs").exists():  # the launcher is starting its processes
        assert p.poll() is None and time.time() < deadline, p.communicate()
        time.sleep(0.05)
    time.sleep(0.5)
    assert not (run_dir / "metrics.jsonl").exists()  # before the first step
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 75, err
    assert "stopped" in err.splitlines()[-1] and "failed" not in err, err
    left = subprocess.run(["pgrep", "-f", str(run_dir)], capture_output=True, text=True).stdout.split()
    assert not left, left
