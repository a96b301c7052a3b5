"""Network faults in the cluster twin, injected into running jobs from outside (`scaletrain twin down|up|slow`,
twin/faults.py): a partition (node k's link down) and a slowed link (a straggler).

A partition is seen from both sides: the cut-off node's processes lose the store (rank 0 serves it) and
name rank 0, while the others see the node's heartbeats stop. The launcher must name the node the others
cannot reach, and each strategy do what it promises: sync ends, mixed-async goes on without the node. A
slowed link holds every update of a sync job; backup's shards need N-b nodes' gradients, so the slow node's
come late and are dropped. Each test checks that the job's namespaces are gone once it ended.

Root and iproute2 only (the twin's namespaces and shaping); digits, resnet8, 2-3 nodes, links of 0.5 Gbit/s.
"""

import json
import os
import signal
import subprocess
import time

import pytest

from conftest import ROOT, scaletrain_cmd
from scaletrain.errors import LaunchError
from scaletrain.launch.local import cut_node
from scaletrain.twin import faults, privileges

TIMEOUT_S = 5
BASE = ["data.workers=0", "cluster.network=netns", "cluster.link_gbps=0.5", f"cluster.timeout_s={TIMEOUT_S}",
        "cluster.num_ps=1", "train.eval_every=0", "train.log_every=2", "train.checkpoint_every=0",
        "train.emulate_compute_s=0.2"]
needs_twin = pytest.mark.skipif(privileges() is not None, reason=f"{privileges()}")


def start(run_dir, env, *sets):
    args = ["train", "--recipe", "recipes/digits.toml", "--run-dir", str(run_dir), "--quiet"]
    for s in (*BASE, *sets):
        args += ["--set", s]
    return subprocess.Popen(scaletrain_cmd(*args), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def train_rows(run_dir):
    metrics = run_dir / "metrics.jsonl"
    return [json.loads(r) for r in metrics.read_text().splitlines() if '"train"' in r] if metrics.exists() else []


def wait_rows(p, run_dir, rows, after=0.0):
    """Until the chief logged `rows` train rows (those logged after time `after`)."""
    deadline = time.time() + 120
    while time.time() < deadline:
        if sum(r["time"] > after for r in train_rows(run_dir)) >= rows:
            return
        assert p.poll() is None, p.communicate()
        time.sleep(0.2)
    raise AssertionError("the job logged too few steps")


def finish(p, timeout=90):
    try:
        return p.communicate(timeout=timeout)
    except BaseException:
        os.killpg(p.pid, signal.SIGKILL)  # a hung job: its processes must not outlive the test
        p.communicate()
        raise


def left_namespaces(run_dir):
    """The job's namespaces (its twin.json) that `ip netns list` still shows."""
    made = json.loads((run_dir / "logs" / "twin.json").read_text())["namespaces"]
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    return [ns for ns in made if ns in listed]


def twin_cli(*args):
    return subprocess.run(scaletrain_cmd("twin", *map(str, args)), cwd=ROOT, capture_output=True, text=True)


def test_the_cut_node_is_the_one_most_others_lost_and_between_two_not_the_chiefs():
    """The launcher's judgement (launch/local.py): each node -> the nodes its processes lost."""
    assert cut_node({0: {1}, 1: {0}}, chief=0) == 1  # two nodes: the chief's side holds the store
    assert cut_node({0: {1}, 2: {1}, 1: {0}}, chief=0) == 1
    assert cut_node({1: {0}, 2: {0}, 0: {1, 2}}, chief=0) == 0  # the chief's node cut off
    assert cut_node({1: {0}, 2: {0}}, chief=0) is None  # nobody lost them back: a frozen chief, no partition
    assert cut_node({}, chief=0) is None


@needs_twin
def test_a_partitioned_node_of_a_sync_job_is_named_and_the_job_ends(tmp_path, env):
    run_dir = tmp_path / "run"
    p = start(run_dir, env, "cluster.nodes=2", "strategy.name=sync", "train.steps=100000")
    try:
        wait_rows(p, run_dir, 2)
        with pytest.raises(LaunchError, match=r"^--node 3: the job's nodes are 1\.\.2"):
            faults.link(run_dir, 3, up=False)
        cut = twin_cli("down", run_dir, "--node", 2)
        t0 = time.time()
        assert cut.returncode == 0 and cut.stdout.strip() == "node 2's link is down: it reaches no other node", cut
    finally:
        _, err = finish(p)
    elapsed, failure = time.time() - t0, run_dir / "logs" / "failure.json"
    named = failure.stat().st_mtime - t0
    print(f"named {named:.1f} s after the cut; the job ended {elapsed:.1f} s after it")
    what = ("node 2 was unreachable (a network partition): node 1 lost contact with its processes, and they with "
            "the rest of the job")
    assert p.returncode == 1, err
    assert err.splitlines()[-1] == f"scaletrain: error: the job failed: {what}; logs in {run_dir / 'logs'}", err
    assert json.loads(failure.read_text()) == {"rank": 1, "role": "worker", "node": 1, "host": None, "what": what}
    # Either side sees the other silent after 3 s + cluster.timeout_s, and the launcher judges once both spoke:
    # 9-10 s here on an idle host.
    assert named <= TIMEOUT_S + 10, (named, err)
    assert elapsed <= TIMEOUT_S + 20, (elapsed, err)
    assert left_namespaces(run_dir) == []
    with pytest.raises(LaunchError, match=f"^{run_dir}: its job is not running"):
        faults.link(run_dir, 2, up=True)


@needs_twin
def test_an_asynchronous_job_goes_on_without_a_partitioned_node(tmp_path, env):
    run_dir = tmp_path / "run"
    p = start(run_dir, env, "cluster.nodes=3", "strategy.name=mixed-async", "train.steps=70")
    try:
        wait_rows(p, run_dir, 2)
        assert faults.link(run_dir, 3, up=False) == "node 3's link is down: it reaches no other node"
        t0 = time.time()
        dropped = run_dir / "logs" / "dropped"
        while not dropped.exists() and p.poll() is None and time.time() - t0 < 60:
            time.sleep(0.2)
        declared = time.time() - t0
        if p.poll() is None:  # the link back: the node's processes were dropped, killed, and stay out
            assert faults.link(run_dir, 3, up=True) == "node 3's link is up"
    finally:
        out, err = finish(p)
    print(f"declared {declared:.1f} s after the cut; the job ended {time.time() - t0:.1f} s after it")
    assert p.returncode == 0, err
    assert dropped.read_text().strip() == "3"
    assert declared <= TIMEOUT_S + 10, (declared, err)
    assert "rank 3 (worker 2 on node 3) sent no heartbeat for 5 s; the job goes on without node 3" in err, err
    assert "unreachable" not in err and "rank 0 (worker 0 on node 1)" not in err, err
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [w["nodes"] for w in summary["lost_workers"]] == [[3]], summary["lost_workers"]
    assert left_namespaces(run_dir) == []


SLOW_GBPS = 0.01  # the cluster's rate of node 3's link once slowed: a push of resnet8's 312 kB takes 0.5 s


@pytest.fixture(scope="module")
def slowed(tmp_path_factory):
    """Jobs of 3 nodes whose node 3's link is slowed mid-run, by strategy: the chief's rate of images applied
    before and after (from 2 s after the change), the slow node's pushes against the fastest one's, and the
    twin's rate of the link. cluster.time_scale = 2: every rate given at the cluster's speed is halved. The
    liveness timeout is the default's: the slow node's beats share its saturated link, and on a loaded host
    TCP's backoff once held them past 5 s, so the job went on without node 3."""
    runs = {}

    def run(strategy):
        if strategy in runs:
            return runs[strategy]
        run_dir = tmp_path_factory.mktemp("slowed") / strategy
        p = start(run_dir, dict(os.environ, OMP_NUM_THREADS="1"), "cluster.nodes=3", f"strategy.name={strategy}",
                  "strategy.backup_workers=1" if strategy == "backup" else "strategy.backup_workers=0",
                  "cluster.time_scale=2", "cluster.link_gbps=1", "train.emulate_compute_s=0.1", "train.steps=24",
                  "cluster.timeout_s=60")
        try:
            wait_rows(p, run_dir, 4)
            said = faults.slow(run_dir, 3, SLOW_GBPS)
            changed = time.time()
            shaped = subprocess.run(["tc", "-n", json.loads((run_dir / "logs" / "twin.json").read_text())[
                "namespaces"][3], "qdisc", "show", "dev", "twin0"], capture_output=True, text=True).stdout
        finally:
            _, err = finish(p)
        assert p.returncode == 0, err
        rows = train_rows(run_dir)
        before, after = [r for r in rows if r["time"] < changed], [r for r in rows if r["time"] > changed + 2]
        assert len(before) >= 4 and len(after) >= 3, (len(before), len(after))
        summary = json.loads((run_dir / "summary.json").read_text())
        assert not summary.get("lost_workers"), (summary["lost_workers"], err)
        pushes = {w["node"]: w["steps"] for w in summary["per_worker"]}
        print(f"{strategy}: {len(before)} rows before, {len(after)} after; ", end="")
        runs[strategy] = {"said": said, "shaped": shaped, "before": rate(before), "after": rate(after),
                          "slow_pushes": pushes[2] / max(pushes.values()), "left": left_namespaces(run_dir)}
        return runs[strategy]

    return run


def rate(rows):
    return (rows[-1]["images"] - rows[0]["images"]) / (rows[-1]["time"] - rows[0]["time"])


@needs_twin
def test_a_slowed_link_holds_a_sync_job_back(slowed):
    got = slowed("sync")
    print(got)
    assert got["said"] == ("node 3's link runs at 0.01 Gbit/s each way (0.005 Gbit/s in the twin: "
                           "cluster.time_scale = 2)")
    assert "rate 5Mbit" in got["shaped"], got["shaped"]
    # Every update waits for node 3's push: 0.5 s each way against 0.2 s of (dilated) compute, a fifth of
    # the rate before (0.2 measured).
    assert got["after"] < 0.4 * got["before"], got
    assert got["slow_pushes"] == 1, got
    assert got["left"] == []


@needs_twin
def test_backup_absorbs_a_slowed_link(slowed):
    got = slowed("backup")
    print(got)
    # The shards apply the first 2 of 3 nodes' gradients: node 3's arrive late and are dropped, so it pushes at
    # about half a fast node's count (0.50 measured). A shard takes the fast nodes' pushes while node 3's
    # gradient crosses its link, so the job keeps its rate (1.00 measured; 0.61 when a shard received one
    # gradient at a time).
    assert got["slow_pushes"] < 0.75, got
    assert got["after"] > 0.8 * got["before"], got
    assert got["left"] == []
