"""calibrate on this machine, then a bench, predict --validate against it, and the report: the
performance model's whole path with real jobs (minutes on two cores, so not a unit test)."""

import json
import os
import statistics
import subprocess
import sys

import pytest

from scaletrain.config import load_config
from scaletrain.perfmodel.calibrate import rederive
from scaletrain.perfmodel.profile import load_profile

from conftest import ROOT


def run(*args, cwd=ROOT, env=None):
    return subprocess.run([sys.executable, "-m", "scaletrain", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600, env=env)


@pytest.mark.long  # benchmarks/long_tests.py
def test_calibrate_bench_validate_report(tmp_path):
    sets = ["--set", "data.workers=0", "--set", "optim.warmup_steps=0", "--set", "cluster.gpus_per_node=2"]
    prof = tmp_path / "local.toml"
    r = run("calibrate", "--recipe", "recipes/digits.toml", *sets, "--steps", "10", "--out", str(prof))
    assert r.returncode == 0, r.stderr
    p, about = load_profile(prof)
    assert p.model == "resnet8" and p.gradient_bytes == 4 * 78042 and p.compute_s > 0 and p.shared_cores >= 1
    assert 0 <= p.compute_base_s < p.compute_s and p.device_memory == 0
    # Every figure once a round, three rounds: the spreads are across rounds.
    assert [x.split(":")[0].strip() for x in r.stdout.splitlines() if x.startswith("  round")] == \
        [f"round {j} of 3" for j in (1, 2, 3)], r.stdout
    assert {"cpu.optimizer_s", "cpu.copy_s", "job1.step_s", "job1_other_batch.step_s", "job2.step_s",
            "ps_job.step_s"} <= set(about["spread"]) == set(about["measured"]) and about["runs"] == 3
    # The measurements it kept give the same profile again.
    again, _ = rederive(prof, load_config(ROOT / "recipes/digits.toml", [s for s in sets if s != "--set"]),
                        say=lambda *_: None)
    assert again == p
    bench = tmp_path / "bench"
    r = run("bench", "--recipe", "recipes/digits.toml", *sets, "--grid", "cluster.nodes=1,2",
            "--grid", "strategy.name+cluster.num_ps=allreduce:0,mixed-async:1", "--warmup", "3", "--steps", "12",
            "--out", str(bench))
    assert r.returncode == 0, r.stderr
    r = run("predict", "--profile", str(prof), "--validate", str(bench), "--format", "json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert len(out["rows"]) == 4
    for row in out["rows"]:
        assert row["rel_error"] == pytest.approx(row["predicted"] / row["measured"] - 1)
    # Measured and predicted speedups are one quantity: both against the 1-node all-reduce row.
    base = next(r for r in out["rows"] if (r["strategy"], r["nodes"]) == ("allreduce", 1))
    assert base["measured_speedup"] == 1.0 and base["predicted_speedup"] == pytest.approx(1.0)
    for row in out["rows"]:
        assert row["measured_speedup"] == pytest.approx(row["measured"] / base["measured"])
        assert row["predicted_speedup"] == pytest.approx(row["predicted"] / base["predicted"])
    assert out["median_abs_error"] == pytest.approx(statistics.median(abs(x["rel_error"]) for x in out["rows"]))
    others = [x for x in out["rows"] if (x["strategy"], x["nodes"]) != ("allreduce", 1)]
    assert [x["baseline"] for x in out["rows"]].count(True) == 1 and len(others) == 3
    assert out["speedup_median_abs_error"] == pytest.approx(
        statistics.median(abs(x["predicted_speedup"] / x["measured_speedup"] - 1) for x in others))
    assert (bench / "validate.md").exists()
    r = run("report", str(bench), "--out", str(tmp_path / "report"))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "report/predicted-measured.png").exists()
    assert "Predicted against measured" in (tmp_path / "report/report.html").read_text()


def test_calibrate_and_predict_a_user_network(tmp_path):
    """A network by import path (tests/user_models.py, on the commands' PYTHONPATH): calibrate
    measures it, its gradient is its own parameters', and predict takes the profile for it (and
    for it only: other model.args are another network)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), *filter(None, [os.getenv("PYTHONPATH")])]))
    sets = ["--set", "data.workers=0", "--set", "model.name=user_models:plain", "--set", "model.args.width=4"]
    prof = tmp_path / "mine.toml"
    r = run("calibrate", "--recipe", "recipes/digits.toml", *sets, "--steps", "5", "--runs", "1", "--out", str(prof),
            env=env)
    assert r.returncode == 0, r.stderr
    p, _ = load_profile(prof)
    assert (p.model, p.model_args, p.image_size) == ("user_models:plain", {"width": 4}, 16)
    assert p.gradient_bytes == 4 * 646  # user_models.plain(10, width=4)'s parameters
    shape = ["--set", "cluster.nodes=2", "--set", "cluster.num_ps=2", "--set", "strategy.name=sync",
             "--set", "cluster.sharding=round-robin"]  # round-robin: the shards' sizes come from the network's tensors
    r = run("predict", "--profile", str(prof), "--recipe", "recipes/digits.toml", *sets, *shape, "--format", "json",
            env=env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)[0]["images_per_sec"] > 0
    r = run("predict", "--profile", str(prof), "--recipe", "recipes/digits.toml", *sets[:4], env=env)
    assert r.returncode == 2 and "measured for user_models:plain {'width': 4}, 16 px; the recipe trains " \
        "user_models:plain, 16 px" in r.stderr, r.stderr


def test_a_calibration_on_a_busy_host_is_flagged_and_recommend_refuses_it(tmp_path):
    """A busy loop on half the cores for the whole of a short calibration: the profile says the host
    was busy (other processes took half the cores' time, twice the bound), and --recommend will not
    use it. Half, not all: a loop on every core doubles the calibration's minute."""
    prof = tmp_path / "busy.toml"
    loops = max(1, (os.cpu_count() or 1) // 2)
    load = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(loops)]
    try:
        r = run("calibrate", "--recipe", "recipes/digits.toml", "--set", "data.workers=0", "--steps", "3",
                "--runs", "1", "--out", str(prof))
    finally:
        for p in load:
            p.kill()
        for p in load:
            p.wait()
    assert r.returncode == 0, r.stderr
    _, about = load_profile(prof)
    busy = [f for f in about["flags"] if f.startswith("other processes took")]
    assert busy and f"  flag: {busy[0]}" in r.stdout, r.stdout
    assert "calibrate: round 1 of 1 done" in r.stderr
    r = run("predict", "--profile", str(prof), "--recipe", "recipes/digits.toml", "--set", "data.workers=0",
            "--recommend", "--max-nodes", "1")
    assert r.returncode == 2 and r.stderr.startswith(f"scaletrain: error: profile {prof} is flagged: "), r.stderr
    assert "--force" in r.stderr and len(r.stderr.splitlines()) == 1
