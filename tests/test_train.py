import json
import subprocess

from safetensors.torch import load_file

from scaletrain.models.resnet import resnet
from scaletrain.train import train

from conftest import ROOT, scaletrain_cmd


def test_digits_reaches_90_percent(digits_cfg, tmp_path):
    s = train(digits_cfg(), tmp_path / "run", progress=False)
    assert s["test_accuracy"] >= 0.90, s
    assert s["best_test_accuracy"] >= s["test_accuracy"]


def test_run_outputs_contract(digits_cfg, tmp_path):
    run = tmp_path / "run"
    s = train(digits_cfg("train.steps=20", "train.eval_every=10", "train.checkpoint_every=5",
                         "train.keep_checkpoints=2"), run, progress=False)
    for f in ("config.toml", "metrics.jsonl", "summary.json", "model.safetensors", "classes.txt"):
        assert (run / f).is_file(), f
    assert json.loads((run / "summary.json").read_text()) == s
    for k in ("steps", "epochs", "wall_seconds", "images_per_sec", "final_train_loss", "test_accuracy",
              "best_test_accuracy", "torch_version", "git_commit", "host", "device", "data_wait_fraction"):
        assert s[k] is not None, k
    assert s["steps"] == 20 and s["images_per_sec"] > 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    trains = [r for r in rows if r["kind"] == "train"]
    evals = [r for r in rows if r["kind"] == "eval"]
    assert [r["step"] for r in trains] == [5, 10, 15, 20]
    assert {"epoch", "wall", "loss", "lr", "images_per_sec", "data_wait_fraction"} <= set(trains[-1])
    assert [r["step"] for r in evals] == [10, 20] and 0 <= evals[-1]["test_accuracy"] <= 1
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["ckpt-00000015.pt", "ckpt-00000020.pt"]
    weights = load_file(str(run / "model.safetensors"))
    assert weights.keys() == resnet("resnet8", 10).state_dict().keys()
    events = list((run / "tb").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tb"))
    acc.Reload()
    assert {"train/loss", "train/lr", "train/images_per_sec", "eval/test_accuracy"} <= set(acc.Tags()["scalars"])


def test_cli_train_plain_progress_when_not_a_terminal(tmp_path, env):
    p = subprocess.run(scaletrain_cmd("train", "--recipe", "recipes/digits.toml", "--set", "train.steps=20",
                                      "--set", "data.workers=0", "--run-dir", str(tmp_path / "r")),
                       capture_output=True, text=True, env=env, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    assert "step 20/20" in p.stdout and "test accuracy" in p.stdout
    assert "\x1b[" not in p.stdout  # no terminal control codes in a log file
