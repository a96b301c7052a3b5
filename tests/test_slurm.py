"""Real Slurm: an emulated 4-node cluster (slurmctld, 4 slurmd, munge) started here, real jobs.

Needs root (munged, slurmd) and the Debian packages `make slurm` installs. Without root these
tests are skipped with that reason; as root a missing package is an error, not a skip.
"""

import json
import os
import subprocess

import pytest

from conftest import RECIPES, ROOT, scaletrain_cmd

import slurm_cluster

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="not root: the emulated Slurm cluster needs root "
                                "to start munged and slurmd")
DIGITS = str(RECIPES / "digits.toml")
SMALL = ["train.device=cpu", "train.steps=20", "data.workers=0", "train.eval_every=0", "train.log_every=5",
         "cluster.timeout_s=30"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = slurm_cluster.available()
    assert reason is None, reason
    with slurm_cluster.Cluster() as c:
        c.start(tmp_path_factory.mktemp("slurm"))
        yield c


def sets(*overrides):
    return [a for o in overrides for a in ("--set", o)]


def submit(cluster, run_dir, *overrides):
    r = subprocess.run(scaletrain_cmd("slurm", "--recipe", DIGITS, "--run-dir", str(run_dir), "--submit", "--wait",
                                      "--time", "00:10:00", *sets(*SMALL, *overrides)),
                       cwd=ROOT, env=cluster.env, capture_output=True, text=True, timeout=300)
    logs = "\n".join(p.read_text() for p in sorted((run_dir / "logs").glob("*")) if p.suffix in (".out", ".log"))
    return r, logs


def placement(run_dir):
    """Each process's record of where it ran, by rank."""
    files = sorted((run_dir / "logs").glob("rank*.json"), key=lambda p: int(p.stem[4:]))
    return [json.loads(p.read_text()) for p in files]


def expected_hosts(run_dir):
    return (run_dir / "logs").glob("hosts-*.txt").__next__().read_text().split()


def test_four_node_mixed_async_job(cluster, tmp_path):
    run_dir = tmp_path / "mixed"
    r, logs = submit(cluster, run_dir, "cluster.nodes=4", "cluster.num_ps=1", "strategy.name=mixed-async")
    assert r.returncode == 0, r.stdout + r.stderr + logs
    assert "submitted batch job" in r.stdout and "test accuracy" in logs
    s = json.loads((run_dir / "summary.json").read_text())
    assert (s["nodes"], s["nodes_total"], s["num_ps"], s["strategy"], s["steps"]) == (4, 4, 1, "mixed-async", 20)
    procs = placement(run_dir)
    assert [(p["role"], p["node"]) for p in procs] == [("worker", 0), ("worker", 1), ("ps", 1), ("worker", 2),
                                                       ("worker", 3)]
    # Every process ran on the Slurm node the plan gave it: node k of the plan is the k-th allocated host.
    hosts = ["node1", "node2", "node3", "node4"]
    assert [p["SLURMD_NODENAME"] for p in procs] == [hosts[p["node"]] for p in procs]
    assert [int(p["SLURM_NODEID"]) for p in procs] == [p["node"] for p in procs]
    assert {p["launcher"] for p in procs} == {"slurm"} and len({p["job"] for p in procs}) == 1


def test_two_node_sync_job_with_a_dedicated_ps_node(cluster, tmp_path):
    run_dir = tmp_path / "sync"
    r, logs = submit(cluster, run_dir, "cluster.nodes=2", "cluster.num_ps=1", "cluster.ps_placement=dedicated",
                     "strategy.name=sync")
    assert r.returncode == 0, r.stdout + r.stderr + logs
    s = json.loads((run_dir / "summary.json").read_text())
    assert (s["nodes"], s["nodes_total"], s["num_ps"], s["ps_placement"]) == (2, 3, 1, "dedicated")
    assert s["staleness_max"] == 0
    procs = placement(run_dir)
    hosts = expected_hosts(run_dir)
    assert [(p["role"], p["node"]) for p in procs] == [("worker", 0), ("worker", 1), ("ps", 2)]
    assert [p["SLURMD_NODENAME"] for p in procs] == hosts
    assert len(set(hosts)) == 3  # the PS has a node of its own


def test_train_inside_an_allocation_uses_slurm(cluster, tmp_path):
    run_dir = tmp_path / "inside"
    cmd = " ".join(scaletrain_cmd("train", "--recipe", DIGITS, "--run-dir", str(run_dir), "--quiet",
                                  *sets(*SMALL, "cluster.nodes=2", "cluster.num_ps=1", "strategy.name=sync")))
    r = subprocess.run(["sbatch", "--wait", "--nodes=2", f"--output={tmp_path}/out-%j.txt", f"--chdir={ROOT}",
                        "--wrap", cmd], env=cluster.env, capture_output=True, text=True, timeout=300)
    out = "\n".join(p.read_text() for p in tmp_path.glob("out-*.txt"))
    assert r.returncode == 0, r.stderr + out
    assert "Slurm job" in out and "test accuracy" in out
    procs = placement(run_dir)
    assert [(p["launcher"], p["SLURMD_NODENAME"]) for p in procs] == \
        [("slurm", h) for h in expected_hosts(run_dir)]
    assert procs[2]["role"] == "ps" and procs[2]["SLURMD_NODENAME"] == procs[1]["SLURMD_NODENAME"]


def test_failed_job_returns_its_status(cluster, tmp_path):
    run_dir = tmp_path / "bad"
    r, logs = submit(cluster, run_dir, "cluster.nodes=2", "cluster.num_ps=1", "strategy.name=sync",
                     "data.name=imagefolder", f"data.root={tmp_path / 'missing'}")
    assert r.returncode != 0
    assert "failed" in r.stderr, r.stderr
    errors = [line for line in logs.splitlines() if str(tmp_path / "missing") in line]
    assert errors and all(line.startswith("scaletrain: error: rank ") for line in errors), logs
    assert "Traceback" not in logs, logs
