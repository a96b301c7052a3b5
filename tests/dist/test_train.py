import json
import os
import subprocess
import sys

from safetensors.torch import load_file

from scaletrain.models.resnet import resnet
from scaletrain.loop import train

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


FAULTS = r'''
import ctypes, resource, sys, torch
from scaletrain.compute import M_MMAP_THRESHOLD, M_TRIM_THRESHOLD, keep_freed_memory
from scaletrain.config import ModelConfig
from scaletrain.models import build_model
torch.set_num_threads(1)
mallopt = ctypes.CDLL(None).mallopt  # glibc's starting thresholds, held: its adaptation off
assert mallopt(M_MMAP_THRESHOLD, 128 << 10) and mallopt(M_TRIM_THRESHOLD, 128 << 10)
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
m = build_model(ModelConfig(name="resnet20", num_classes=10))
x, y = torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))
def step():
    torch.nn.functional.cross_entropy(m(x), y).backward()
for _ in range(3):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    step()
print(kept, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5)
'''


def test_freed_memory_is_kept_for_the_next_step(tmp_path):
    """Page faults per step of a real model, with the allocator as a worker sets it and with glibc's
    starting thresholds; a user's own MALLOC_*_THRESHOLD_ setting is left alone.

    Both runs start from glibc's thresholds held fixed. Left to itself glibc raises its mmap
    threshold as it frees mmapped chunks, so a step then faults anywhere from a few hundred to
    several thousand pages by the process's history, which no bound can be drawn on."""
    script = tmp_path / "faults.py"
    script.write_text(FAULTS)

    def faults(mode: str, **env) -> tuple[str, float]:
        out = subprocess.run([sys.executable, str(script), mode], capture_output=True, text=True, check=True,
                             env={**os.environ, **env}).stdout.split()
        return out[0], float(out[1])

    kept, few = faults("keep")
    _, many = faults("default")
    assert kept == "True" and many > 10_000 and few < many / 20, (few, many)
    assert faults("keep", MALLOC_TRIM_THRESHOLD_="131072")[0] == "False"
