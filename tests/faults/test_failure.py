"""No hangs: a dead process stops the whole job within the timeout, naming the rank."""

import json
import os
import signal
import subprocess
import time

from conftest import ROOT, scaletrain_cmd

TIMEOUT_S = 5


def start(tmp_path, env):
    run_dir = tmp_path / "run"
    cmd = scaletrain_cmd("train", "--recipe", "recipes/digits.toml", "--run-dir", str(run_dir), "--quiet",
                         "--set", "cluster.nodes=2", "--set", "cluster.gpus_per_node=2", "--set", "cluster.num_ps=1",
                         "--set", "strategy.name=sync", "--set", "train.steps=100000", "--set", "data.workers=0",
                         "--set", f"cluster.timeout_s={TIMEOUT_S}", "--set", "train.eval_every=0")
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    pids, deadline = {}, time.time() + 120
    while time.time() < deadline:  # wait until every process trains
        pids = {int(f.stem[4:]): json.loads(f.read_text())["pid"] for f in (run_dir / "logs").glob("rank*.json")} \
            if (run_dir / "logs").exists() else {}
        metrics = run_dir / "metrics.jsonl"
        if len(pids) == 5 and metrics.exists() and len(metrics.read_text().splitlines()) > 8:
            return p, pids, run_dir
        assert p.poll() is None, p.communicate()
        time.sleep(0.5)
    raise AssertionError("job did not start")


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie has exited; only its parent has not reaped it yet
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().split(")")[-1].split()[0] != "Z"


def test_killed_worker_stops_every_process_naming_it(tmp_path, env):
    p, pids, run_dir = start(tmp_path, env)
    os.kill(pids[2], signal.SIGKILL)  # rank 2: worker 2, leader of node 1
    t0 = time.time()
    _, err = p.communicate(timeout=TIMEOUT_S + 30)
    elapsed = time.time() - t0
    assert p.returncode != 0
    assert "rank 2 (worker 2 on node 2) was killed by signal SIGKILL" in err
    assert elapsed <= TIMEOUT_S + 10, elapsed
    assert not any(alive(pid) for pid in pids.values())
    # the survivors noticed on their own (before the launcher's grace ran out) and named the lost rank
    logs = [(run_dir / "logs" / f"rank{r}.log").read_text() for r in (1, 3, 4)]
    assert all("rank 2 (worker 2 on node 2)" in text for text in logs), logs


def test_ctrl_c_stops_every_process(tmp_path, env):
    p, pids, _ = start(tmp_path, env)
    os.killpg(p.pid, signal.SIGINT)  # what a terminal sends to the foreground process group
    _, err = p.communicate(timeout=30)
    assert p.returncode == 130, err
    assert not any(alive(pid) for pid in pids.values())
