"""doctor inside a real two-node Slurm allocation (the emulated cluster, tests/slurm_cluster.py):
each node's report reads the allocation it runs in."""

import json
import subprocess

import pytest

from conftest import ROOT, scaletrain_cmd
import slurm_cluster


@pytest.mark.skipif(slurm_cluster.available() is not None, reason=str(slurm_cluster.available()))
def test_inside_a_two_node_allocation(tmp_path):
    with slurm_cluster.Cluster() as c:
        c.start(tmp_path / "slurm")
        r = subprocess.run(["srun", "-N2", f"--output={tmp_path}/doctor-%t.json", f"--chdir={ROOT}",
                            *scaletrain_cmd("doctor", "--format", "json")],
                           env=c.env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    reps = [json.loads((tmp_path / f"doctor-{t}.json").read_text()) for t in (0, 1)]
    assert [rep["slurm"]["node"] for rep in reps] == ["node1", "node2"]
    for rep in reps:
        s = rep["slurm"]
        assert s["allocation"] and s["job_id"] == reps[0]["slurm"]["job_id"] and s["job_id"].isdigit()
        assert (s["nodes"], s["tasks"], s["cpus_on_node"], s["gpus"]) == (["node1", "node2"], "2", "8", 0)
        assert rep["network"]["gloo"]["why"] != "loopback: every process on this machine"
