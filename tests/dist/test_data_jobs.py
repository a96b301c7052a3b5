"""Data checks and loading as a job meets them: real processes, the launcher's manifest check,
the warning a slow input gives."""

import json
import subprocess

from conftest import scaletrain_cmd, write_images


def test_a_job_checks_its_manifest_once_before_its_processes_start(tmp_path, env):
    """A 2-node local job: a missing file stops it in one line naming the file and its row before any
    process starts; a good manifest is checked by the launcher, and its chief finds the record."""
    rows = write_images(tmp_path / "data")
    m = tmp_path / "data" / "m.csv"
    good = "".join(f"{p},{c}\n" for p, c in rows)
    m.write_text(good + "nothere.jpg,sad_dog\n")
    run = tmp_path / "run"
    cmd = scaletrain_cmd("train", "--recipe", "recipes/digits.toml", "--quiet", "--set", "data.name=manifest",
                         "--set", f"data.root={m}", "--set", "model.num_classes=3", "--set", "model.width=4",
                         "--set", "cluster.nodes=2", "--set", "data.batch_size=4", "--set", "data.workers=0",
                         "--set", "data.test_fraction=0", "--set", "train.steps=2", "--run-dir", str(run))
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert p.returncode == 1
    assert p.stderr.splitlines() == [f"scaletrain: error: {m} line 13: image {tmp_path / 'data' / 'nothere.jpg'} "
                                     "does not exist"]
    assert not list(run.glob("logs/rank*"))  # no process was started
    m.write_text(good)
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert p.returncode == 0, p.stderr
    # written before the processes started (rank0.json is the chief's first act), not again by the chief
    assert (run / "logs" / "manifest-checked.json").stat().st_mtime_ns < (run / "logs" / "rank0.json").stat().st_mtime_ns


def test_slow_loading_is_named_once(tmp_path, env):
    """Photo-sized JPEGs decoded in the training process (data.workers = 0) keep a tiny model
    waiting: one warning names data.workers; with the images in memory and a loader process
    there is none."""
    write_images(tmp_path / "data", per_class=8, size=(500, 375))
    common = ["--recipe", "recipes/digits.toml", "--quiet", "--set", "model.num_classes=3",
              "--set", "model.width=4", "--set", "data.batch_size=8", "--set", "train.steps=24",
              "--set", "train.log_every=2", "--set", "data.workers=0"]
    slow = subprocess.run(scaletrain_cmd("train", *common, "--set", "data.name=imagefolder", "--set",
                                         f"data.root={tmp_path / 'data'}", "--run-dir", str(tmp_path / "a")),
                          capture_output=True, text=True, env=env)
    assert slow.returncode == 0, slow.stderr
    assert slow.stderr.count("waited for data") == 1 and "data.workers = 0 loader processes" in slow.stderr
    rows = [json.loads(l) for l in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["data_wait_fraction"] > 0.1 for r in rows if r.get("data_wait_fraction") is not None)
    assert json.loads((tmp_path / "a" / "summary.json").read_text())["data_wait_fraction"] >= 0.25
    fast = subprocess.run(scaletrain_cmd("train", *common, "--set", "model.num_classes=10", "--set", "data.workers=1",
                                         "--set", "model.name=resnet20", "--set", "model.width=16",
                                         "--set", "data.image_size=32", "--set", "data.batch_size=32",
                                         "--run-dir", str(tmp_path / "b")), capture_output=True, text=True, env=env)
    assert fast.returncode == 0 and "waited for data" not in fast.stderr
