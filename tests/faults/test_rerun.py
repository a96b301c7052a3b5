"""The command of a finished run, run again: nothing is overwritten; with a larger target it continues."""

import json
import subprocess

from conftest import ROOT, scaletrain_cmd

SETS = ["data.workers=0", "train.log_every=5", "train.eval_every=0", "train.checkpoint_every=5",
        "cluster.timeout_s=5"]


def train(run_dir, env, *sets):
    args = ["train", "--recipe", "recipes/digits.toml", "--run-dir", str(run_dir), "--quiet"]
    for s in (*SETS, *sets):
        args += ["--set", s]
    return subprocess.run(scaletrain_cmd(*args), cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def files(run_dir):
    """Every file under run_dir with its bytes and modification time."""
    return {str(p.relative_to(run_dir)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(run_dir.rglob("*")) if p.is_file()}


def assert_finished_untouched(run_dir, env, *sets):
    before = files(run_dir)
    assert "summary.json" in before and "config.toml" in before
    r = train(run_dir, env, *sets)
    assert r.returncode == 0, r.stderr
    lines = [x for x in (r.stdout + r.stderr).splitlines() if x.strip()]
    assert len(lines) == 1, lines
    assert "finished run" in lines[0] and str(run_dir / "summary.json") in lines[0], lines
    assert files(run_dir) == before


def test_a_finished_run_run_again_is_left_as_it_is_and_more_steps_continue_it(tmp_path, env):
    run_dir = tmp_path / "run"
    r = train(run_dir, env, "train.steps=10")
    assert r.returncode == 0, r.stderr
    assert_finished_untouched(run_dir, env, "train.steps=10")
    assert_finished_untouched(run_dir, env, "train.steps=5")  # a smaller target: over too
    r = train(run_dir, env, "train.steps=15")
    assert r.returncode == 0, r.stderr
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["start_step"] == 10 and s["steps"] == 15, s
    r = train(run_dir, env, "train.steps=15", "optim.lr=0.5")  # not only its length: refused as before
    assert r.returncode == 1 and "optim.lr" in r.stderr, r.stderr


def test_a_finished_distributed_run_run_again_is_left_as_it_is(tmp_path, env):
    run_dir = tmp_path / "run"
    r = train(run_dir, env, "train.steps=10", "cluster.nodes=2")
    assert r.returncode == 0, r.stderr
    assert_finished_untouched(run_dir, env, "train.steps=10", "cluster.nodes=2")


def test_a_bench_cell_run_again_into_its_own_out_keeps_its_figures(tmp_path):
    """A sweep run again into the same OUT: a finished cell's row is its summary, not an error."""
    from scaletrain.study import bench

    sets = [*SETS, "train.steps=5", "model.name=resnet8"]
    first, second = {}, {}
    summary = bench.run_cell(str(ROOT / "recipes" / "digits.toml"), sets, tmp_path, "cell", first)
    before = files(tmp_path / "cells" / "cell")
    again = bench.run_cell(str(ROOT / "recipes" / "digits.toml"), sets, tmp_path, "cell", second)
    assert "error" not in second and again["images_per_sec"] == summary["images_per_sec"] > 0
    assert files(tmp_path / "cells" / "cell") == before
