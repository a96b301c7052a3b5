"""Jobs of several processes on a user's dataset (data.name = "user_data:FACTORY", tests/user_data.py):
every process imports the module, which PYTHONPATH makes importable where the job runs."""

import json
import os
import re

import torch
from safetensors.torch import load_file

from scaletrain.cli import main

from conftest import RECIPES, ROOT


def importable(monkeypatch, *folders):
    # the launcher's starter is a new interpreter: it finds the user's module as a user's job would
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([*map(str, folders), str(ROOT / "src"),
                                                      os.environ.get("PYTHONPATH", "")]))


def train_args(run_dir, *overrides, resume=False):
    args = ["train", "--recipe", str(RECIPES / "digits.toml"), "--run-dir", str(run_dir), "--quiet",
            *(["--resume"] if resume else [])]
    for o in ["data.workers=0", "train.log_every=1", *overrides]:
        args += ["--set", o]
    return args


def run(tmp_path, monkeypatch, name, *overrides, resume=False):
    importable(monkeypatch, ROOT / "tests")
    run_dir = tmp_path / name
    assert main(train_args(run_dir, *overrides, resume=resume)) == 0, \
        sorted((run_dir / "logs").glob("*.log")) if (run_dir / "logs").exists() else run_dir
    return json.loads((run_dir / "summary.json").read_text()), load_file(str(run_dir / "model.safetensors"))


def max_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_a_sync_job_of_two_nodes_learns_a_users_dataset(tmp_path, monkeypatch):
    """The job's length in epochs: the PS shard makes the dataset too, to count the epoch's images."""
    s, _ = run(tmp_path, monkeypatch, "sync", "data.name=user_data:digits", "data.args={count = 800}",
               "cluster.nodes=2", "cluster.num_ps=1", "strategy.name=sync", "data.batch_size=16",
               "train.steps=0", "train.epochs=10", "optim.warmup_steps=5", "optim.lr=0.1", "optim.schedule=constant",
               "train.eval_every=0")
    assert s["replicas"] == 2 and s["num_ps"] == 1 and s["steps"] == 10 * (720 // 32)
    assert s["test_images"] == 80 and s["test_accuracy"] >= 0.6, s
    assert s["images_per_sec"] > 0
    assert (tmp_path / "sync" / "classes.txt").read_text().splitlines() == [f"digit {i}" for i in range(10)]


def test_a_resumed_job_on_a_users_dataset_is_the_straight_job(tmp_path, monkeypatch):
    setup = ["data.name=user_data:digits_split", "data.args={count = 400}", "cluster.nodes=2",
             "strategy.name=allreduce", "data.batch_size=8", "data.augment=crop+flip", "train.deterministic=true",
             "optim.schedule=constant", "optim.warmup_steps=0", "train.warmup_log_steps=0"]
    _, straight = run(tmp_path, monkeypatch, "straight", *setup, "train.steps=10")
    run(tmp_path, monkeypatch, "split", *setup, "train.steps=5")
    s, resumed = run(tmp_path, monkeypatch, "split", *setup, "train.steps=10", resume=True)
    assert s["start_step"] == 5 and s["steps"] == 10
    # the weights bit for bit; BatchNorm's running statistics, averaged over the replicas when they are
    # saved, to the last bit of float32 (so are those of the built-in digits)
    assert all(torch.equal(straight[k], resumed[k]) for k in straight if "running_" not in k)
    assert max_diff(straight, resumed) <= 1e-6
    # and the comparison can tell runs apart: a step fewer differs
    _, shorter = run(tmp_path, monkeypatch, "shorter", *setup, "train.steps=9")
    assert max_diff(straight, shorter) > 1e-3


def test_processes_that_cannot_import_the_users_module_say_so_in_one_line(tmp_path, monkeypatch, capfd):
    """The launcher imports the module (here: pytest has tests/ on its path), the job's processes
    do not (not on their PYTHONPATH): as a module found on a login node but not on the compute nodes.
    Each process stops with one line naming data.name, not a traceback."""
    importable(monkeypatch)
    run_dir = tmp_path / "run"
    assert main(train_args(run_dir, "data.name=user_data:digits", "cluster.nodes=2")) == 1
    # the chief's line on the terminal, the other's in its log
    out = capfd.readouterr().err + "".join(p.read_text() for p in (run_dir / "logs").glob("rank*.log"))
    said = re.findall(r"scaletrain: error: rank \d \(worker \d on node \d\): data\.name = 'user_data:digits': "
                      r"module user_data does not import: ModuleNotFoundError: No module named 'user_data' \(it must "
                      r"be importable where the job runs, on every node", out)
    assert len(said) == 2 and "Traceback" not in out, out
