"""calibrate where the user will run (perfmodel/net_where.py): the network's microbenchmark over the
cluster twin's shaped link, and as a Slurm job of two nodes on the emulated cluster
(tests/slurm_cluster.py). Those two need root (namespaces and tc; munged and slurmd) and are
skipped elsewhere; compute is emulated in them: they are about where the network is measured, not
the model's speed. The placement's pure parts, and the refusals, take no process."""

import os
import shutil
import subprocess

import pytest

from conftest import RECIPES, ROOT, scaletrain_cmd
from scaletrain.errors import LaunchError
from scaletrain.perfmodel import calibrate_slurm, net_where
from scaletrain.perfmodel.profile import Profile, load_profile
from test_slurm import cluster  # noqa: F401 - the emulated 4-node cluster, started once for this module

SHORT = ["--recipe", str(RECIPES / "digits.toml"), "--runs", "1", "--steps", "5", "--no-input",
         "--set", "data.workers=0", "--set", "train.emulate_compute_s=0.01", "--set", "train.eval_every=0"]


def test_a_two_node_allocation_measures_between_its_nodes_and_runs_the_jobs_here(digits_cfg):
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "gpu[1-2]", "SLURM_NNODES": "2", "PATH": "/bin"}
    where, _ = net_where.place(digits_cfg(), 1000, env)
    assert where.text == "between Slurm nodes gpu1 and gpu2 (job 7)" and where.separate
    assert where.elements == net_where.BIG_MIN
    assert env == {"PATH": "/bin"}  # calibrate's jobs: the local launcher's, on this node
    alone = {"SLURM_JOB_ID": "8", "SLURM_JOB_NODELIST": "gpu1"}
    assert net_where.place(digits_cfg(), 1000, alone)[0] is None and "SLURM_JOB_ID" in alone


def test_the_placed_pair_sets_the_network_figures_at_the_clusters_speed():
    n = 1000
    m = {"net": {"p2p_1": 1e-4, f"p2p_{n}": 1e-4 + 4 * n / 12.5e6}}  # 12.5 MB/s: a 0.1 Gbit/s twin link
    host = {"network": "twin link 0.2 Gbit/s, run at 0.1 Gbit/s", "net_elements": n, "net_scale": 2.0,
            "net_separate": False}
    prof, about = net_where.net_figures(Profile(shared_cores=2), {}, m, host, say=lambda *_: None)
    assert prof.net_bandwidth == pytest.approx(25e6) and prof.net_latency == pytest.approx(5e-5)
    assert prof.shared_cores == 2 and about["network"] == host["network"]
    prof, about = net_where.net_figures(Profile(), {}, {}, {}, say=lambda *_: None)
    assert prof == Profile() and about["network"] == net_where.LOOPBACK


def test_what_cannot_run_here_is_one_line(digits_cfg, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(net_where.twins, "privileges", lambda: "cluster.network = netns needs root")
    with pytest.raises(LaunchError, match="^calibrate in the cluster twin: cluster.network = netns needs root$"):
        net_where.place(digits_cfg("cluster.network=netns"), 1000, {})
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch
    rc = calibrate_slurm.slurm_command(str(RECIPES / "digits.toml"), [], tmp_path / "p.toml", 5, 1, False,
                                       submit=True)
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("scaletrain: error: calibrate --slurm --submit: sbatch not found on PATH")
    assert err.count("\n") == 1 and not (tmp_path / "p-slurm").exists()


def namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("tc"), reason="the twin needs root and iproute2")
def test_calibrate_in_the_twin_measures_the_network_over_its_link(tmp_path, env):
    out, pids = tmp_path / "twin.toml", []
    for _ in range(2):  # a second try where the twin's self-test found the cores too busy for its link
        p = subprocess.Popen(scaletrain_cmd("calibrate", *SHORT, "--set", "cluster.network=netns",
                                            "--set", "cluster.link_gbps=0.2", "--out", str(out)),
                             cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        stdout, stderr = p.communicate(timeout=300)
        pids.append(p.pid)
        if "the cluster twin delivers" not in stderr:
            break
    assert p.returncode == 0, stdout + stderr
    prof, about = load_profile(out)
    link = 0.2e9 / 8  # bytes/s; tbf counts frames, so the payload is a few percent less
    assert 0.5 * link <= prof.net_bandwidth <= 1.1 * link, stdout
    assert "twin link 0.2 Gbit/s" in about["network"] and about["network"] in about["note"]
    assert prof.shared_cores > 0  # the twin's nodes share this host's cores
    assert not {ns for ns in namespaces() for pid in pids if ns.startswith(f"st{pid}")}  # every twin is gone


@pytest.mark.skipif(os.geteuid() != 0, reason="not root: the emulated Slurm cluster needs root")
def test_calibrate_as_a_two_node_slurm_job(cluster, tmp_path):  # noqa: F811 - the fixture above
    out = tmp_path / "cluster.toml"
    r = subprocess.run(scaletrain_cmd("calibrate", *SHORT, "--out", str(out), "--slurm", "--submit", "--wait",
                                      "--time", "00:10:00"),
                       cwd=ROOT, env=cluster.env, capture_output=True, text=True, timeout=300)
    folder = tmp_path / "cluster-slurm"
    logs = "\n".join(p.read_text() for p in (folder / "logs").glob("*.out"))
    assert r.returncode == 0, r.stdout + r.stderr + logs
    assert "#SBATCH --nodes=2" in (folder / "job.sbatch").read_text()
    prof, about = load_profile(out)
    # The emulated nodes are one host: the placement is Slurm's, the network loopback.
    assert about["network"].startswith("between Slurm nodes node1 and node2 (job "), about["network"]
    assert prof.shared_cores == 0 and prof.net_bandwidth > 0
