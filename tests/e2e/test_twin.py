"""The cluster twin (cluster.network = netns, docs/twin.md): a 2-node job whose nodes each have a
network namespace and a shaped link. As root, with iproute2; skipped elsewhere."""

import json
import os
import shutil
import signal
import subprocess
import time

import pytest

from conftest import RECIPES, ROOT, scaletrain_cmd

from scaletrain.twin.selftest import FRAMING, TOLERANCE

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("tc"), reason="the twin needs root and iproute2")

JOB = ["cluster.network=netns", "cluster.nodes=2", "cluster.num_ps=1", "strategy.name=sync", "data.workers=0",
       "train.eval_every=0", "train.checkpoint_every=0", "model.name=resnet20", "train.emulate_compute_s=0.02"]


def namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def cmd(run_dir, *sets):
    return scaletrain_cmd("train", "--recipe", str(RECIPES / "digits.toml"), "--run-dir", str(run_dir), "--quiet",
                          *(a for s in (*JOB, *sets) for a in ("--set", s)))


def train(run_dir, env, *sets):
    r = subprocess.run(cmd(run_dir, *sets), cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads((run_dir / "summary.json").read_text()), json.loads((run_dir / "logs" / "twin.json").read_text())


def test_a_two_node_job_runs_in_two_namespaces_on_links_at_the_set_rate(tmp_path, env):
    fast, fast_twin = train(tmp_path / "fast", env, "cluster.link_gbps=1", "train.steps=10")
    slow, slow_twin = train(tmp_path / "slow", env, "cluster.link_gbps=0.1", "train.steps=10")
    ranks = [json.loads((tmp_path / "fast" / "logs" / f"rank{r}.json").read_text()) for r in range(3)]
    # every process in its node's namespace, with its node's address on the twin's interface
    by_node = {}
    for r in ranks:
        by_node.setdefault(r["node"], set()).add(r["net_namespace"])
        assert r["addresses"].get("twin0") == f"198.18.0.{r['node'] + 1}"
    assert all(len(ns) == 1 for ns in by_node.values()) and len(by_node) == 2
    assert len(set.union(*by_node.values()) | {os.stat("/proc/self/ns/net").st_ino}) == 3  # none in the host's
    assert ranks[0]["rendezvous"].startswith("198.18.0.1:")
    for twin, rate in ((fast_twin, 1.0), (slow_twin, 0.1)):
        # node 1 -> 2 and 2 -> 1 at once, each a link's rate of payload but its frames' headers and the other's acks
        assert twin["self_test"]["pairs"] == [[1, 2], [2, 1]] and twin["self_test"]["set_gbps"] == [rate, rate]
        # The twin's own bound (twin/selftest.py): the payload a link of the set rate carries, its frames'
        # headers aside, at least TOLERANCE of it; never more than the rate
        assert twin["self_test"]["of_payload_rate"] >= TOLERANCE, twin["self_test"]
        assert all(rate * FRAMING * TOLERANCE <= g <= rate * 1.02 for g in twin["self_test"]["measured_gbps"]), twin
    assert fast["twin"]["time_scale"] == 1.0
    # ~1.1 MB each way a step: ~10 ms at 1 Gbit/s, ~90 ms at 0.1 Gbit/s
    assert slow["time_split_s"]["comm_s"] > 3 * fast["time_split_s"]["comm_s"]
    assert slow["images_per_sec"] < fast["images_per_sec"]
    assert not set(fast_twin["namespaces"] + slow_twin["namespaces"]) & namespaces()  # nothing left


def test_nothing_is_left_after_a_failure_or_a_killed_launcher(tmp_path, env):
    # a failure: one process killed mid-run; the job ends, naming it, and its twin is removed
    p = subprocess.Popen(cmd(tmp_path / "fail", "cluster.link_gbps=0.5", "train.steps=2000", "cluster.timeout_s=5"),
                         cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    rank1 = wait_for(tmp_path / "fail" / "logs" / "rank1.json")
    made = set(json.loads((tmp_path / "fail" / "logs" / "twin.json").read_text())["namespaces"])
    assert made <= namespaces()
    os.kill(rank1["pid"], signal.SIGKILL)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 1 and "rank 1" in err, err
    assert not made & namespaces()
    # the launcher killed with -9: its processes die with it; what its twin made stays until the next
    # start of a twin (or `scaletrain twin clean`) removes it
    p = subprocess.Popen(cmd(tmp_path / "killed", "cluster.link_gbps=0.5", "train.steps=2000"), cwd=ROOT, env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    wait_for(tmp_path / "killed" / "logs" / "rank1.json")
    made = set(json.loads((tmp_path / "killed" / "logs" / "twin.json").read_text())["namespaces"])
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    assert made <= namespaces()
    # one no twin record names (another program's, say) is never touched
    subprocess.run(["ip", "netns", "add", "st0n0"], check=True)
    try:
        r = subprocess.run(scaletrain_cmd("twin", "clean"), cwd=ROOT, env=env, capture_output=True, text=True)
        assert r.returncode == 0 and all(ns in r.stdout for ns in made), r.stdout + r.stderr
        assert not made & namespaces() and "st0n0" in namespaces()
    finally:
        subprocess.run(["ip", "netns", "del", "st0n0"], check=True)


def wait_for(path, timeout=120):
    end = time.time() + timeout
    while time.time() < end:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            time.sleep(0.2)
    raise AssertionError(f"{path} was not written in {timeout} s")


def test_a_twin_its_cpus_cannot_carry_is_refused_after_every_round_fell_short():
    """Links far faster than this machine's CPUs move data over veth (a 2-node ring at 200 Gbit/s each
    way; about 12 Gbit/s is carried here, one way): every round falls short, and the refusal names the
    pair, the rounds and a time scale; a link the machine carries passes."""
    from scaletrain.errors import LaunchError
    from scaletrain.twin import Twin, check
    from scaletrain.twin.selftest import ROUNDS
    with Twin.make(2, 200.0) as twin:
        with pytest.raises(LaunchError, match=r"from node \d to node \d .*\(3 rounds, the best given\).*"
                                              r"set cluster.time_scale \d+x higher"):
            check(twin, seconds=0.05)
    with Twin.make(2, 0.5) as twin:
        got = check(twin, seconds=0.25)
    assert 1 <= got["rounds"] <= ROUNDS and got["of_payload_rate"] >= TOLERANCE, got
