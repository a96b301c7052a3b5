"""Your own network by import path in real jobs (tests/user_models.py): the strategies, checkpoints,
resume and evaluation work on it as on the built-in ResNets, against the same single-process
references as tests/dist/test_strategies.py.

The job's processes import the user's module themselves: the tests put its folder on their
PYTHONPATH, as a user does (the module must be importable where the job runs, on every node)."""

import json
import os
import subprocess

import pytest
import torch
from safetensors.torch import load_file

import user_models
from scaletrain.checkpoint import list_complete

from conftest import ROOT, scaletrain_cmd
from test_strategies import EXACT, cluster, latest_checkpoint, max_diff, run

TESTS = ROOT / "tests"
# test_strategies' deterministic settings, less model.norm (the built-in ResNets' only)
PLAIN = ["model.name=user_models:plain", *(s for s in EXACT if not s.startswith("model.norm"))]


@pytest.fixture(autouse=True)
def importable(monkeypatch):
    """The job's processes find user_models on their PYTHONPATH (this process has tests/ on sys.path)."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])]))


def test_user_network_sync_and_allreduce_equal_one_process_exactly(tmp_path):
    """No normalisation: the mean gradient of 4 replicas of 8 images is that of one process's 32."""
    b = 8
    s_single, single = run(tmp_path, "single", *PLAIN, f"data.batch_size={4 * b}")
    s_sync, sync = run(tmp_path, "sync", *PLAIN, f"data.batch_size={b}", *cluster(2, 2, 1, "sync"))
    _, allreduce = run(tmp_path, "allreduce", *PLAIN, f"data.batch_size={b}", *cluster(2, 2))
    assert s_sync["replicas"] == 4 and s_sync["num_ps"] == 1 and s_sync["staleness_max"] == 0
    assert single.keys() == user_models.plain(10).state_dict().keys()  # names as the network has them
    assert s_single["parameters"] == s_sync["parameters"] == sum(p.numel() for p in user_models.plain(10).parameters())
    assert max_diff(single, sync) <= 1e-5
    assert max_diff(single, allreduce) <= 1e-5
    _, longer = run(tmp_path, "longer", *PLAIN, "train.steps=6", f"data.batch_size={4 * b}")
    assert max_diff(single, longer) > 1e-4  # and the comparison can fail


def test_user_network_sync_resume_is_exact(tmp_path):
    """5 steps, then a resume to 10, is 10 straight: the network's values and momentum on the PS."""
    setup = [*PLAIN, "optim.momentum=0.9", "data.batch_size=8", *cluster(2, 2, 1, "sync")]
    _, straight = run(tmp_path, "straight", *setup, "train.steps=10")
    run(tmp_path, "split", *setup, "train.steps=5")
    assert latest_checkpoint(tmp_path / "split")["ps"][0]["version"] == 5
    s, resumed = run(tmp_path, "split", *setup, "train.steps=10", resume=True)
    assert s["start_step"] == 5 and s["steps"] == 10
    assert max_diff(straight, resumed) <= 1e-5


@pytest.mark.parametrize("shape", [cluster(2, 2, 1, "mixed-async"), cluster(2, 1, 0, "async-allreduce")],
                         ids=["mixed-async-2x2", "async-allreduce-2x1"])
def test_batchnorm_user_network_trains_asynchronously(tmp_path, env, shape):
    """BatchNorm buffers (kept per replica) through the CLI in a subprocess, as a user runs it:
    PYTHONPATH in the command's environment, the module in no installed package."""
    run_dir = tmp_path / "r"
    sets = ["model.name=user_models:batchnorm", "model.args.width=4", "data.workers=0", "train.steps=8",
            "train.eval_every=4", "train.checkpoint_every=4", "data.batch_size=16", *shape]
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), *filter(None, [env.get("PYTHONPATH")])])
    p = subprocess.run(scaletrain_cmd("train", "--recipe", "recipes/digits.toml", "--run-dir", str(run_dir),
                                      "--quiet", *(a for s in sets for a in ("--set", s))),
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stderr
    s = json.loads((run_dir / "summary.json").read_text())
    # async-allreduce's last update applies every gradient its round carried: with a network this
    # small, many a replica, so the job may end past step 8
    assert s["steps"] >= 8 and s["model"] == "user_models:batchnorm" and 0 <= s["test_accuracy"] <= 1
    assert [step for step, _ in list_complete(run_dir / "checkpoints")][-1] == s["steps"]
    weights = load_file(str(run_dir / "model.safetensors"))
    own = user_models.batchnorm(10, width=4).state_dict()
    assert weights.keys() == own.keys() and "features.1.running_mean" in weights
    assert all(weights[k].shape == v.shape for k, v in own.items())  # model.args reached the factory
    assert not torch.equal(weights["features.1.running_mean"], own["features.1.running_mean"])  # it trained
    assert "[model.args]\nwidth = 4" in (run_dir / "config.toml").read_text()
