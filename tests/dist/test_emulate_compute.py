"""train.emulate_compute_s: emulated GPUs (a sleep and a fixed gradient) under real strategies."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from scaletrain.perfmodel import scaling
from scaletrain.cli import main
from scaletrain.config import ConfigError, load_config
from scaletrain.models import build_model

from conftest import RECIPES

T = 0.05
STEPS = 10
BATCH = 8
BASE = ["train.eval_every=0", "data.workers=0", f"train.steps={STEPS}", "train.log_every=2",
        "train.warmup_log_steps=2", f"data.batch_size={BATCH}", "train.checkpoint_every=0",
        "optim.schedule=constant", "optim.warmup_steps=0", "train.threads=1"]


def run(tmp_path, name, *overrides):
    run_dir = tmp_path / name
    args = ["train", "--recipe", str(RECIPES / "digits.toml"), "--run-dir", str(run_dir), "--quiet"]
    for o in overrides:
        args += ["--set", o]
    rc = main(args)
    assert rc == 0, (run_dir / "logs").exists() and sorted((run_dir / "logs").glob("*.log"))
    return json.loads((run_dir / "summary.json").read_text()), load_file(str(run_dir / "model.safetensors"))


def cluster(nodes, ps=0, strategy="allreduce"):
    return [f"cluster.nodes={nodes}", f"cluster.num_ps={ps}", f"strategy.name={strategy}"]


def step_seconds(s):
    """Mean seconds of a job step over the timed windows: a step applies replicas x batch images."""
    return s["replicas"] * BATCH / s["images_per_sec"]


def max_diff(a, b):
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def test_config():
    assert load_config(None).train.emulate_compute_s == 0.0
    assert load_config(None, ["train.emulate_compute_s=1"]).train.emulate_compute_s == 1.0
    with pytest.raises(ConfigError, match=r"train.emulate_compute_s = 61.0: out of range \[0.0, 60.0\]"):
        load_config(None, ["train.emulate_compute_s=61"])
    with pytest.raises(ConfigError, match=r"train.emulate_compute_s = -0.5: out of range"):
        load_config(None, ["train.emulate_compute_s=-0.5"])
    # Emulated gradients are made up: evaluating them, or stopping on a target, means nothing.
    with pytest.raises(ConfigError, match=r"^train.eval_every = 100: train.emulate_compute_s = 0.2 .*"
                                          r"set train.eval_every = 0$"):
        load_config(RECIPES / "digits.toml", ["train.emulate_compute_s=0.2"])
    for key, value in (("target_accuracy", 0.9), ("target_loss", 0.5)):
        with pytest.raises(ConfigError, match=rf"^train.{key} = {value}: .* set train.{key} = 0$"):
            load_config(None, ["train.emulate_compute_s=0.2", "train.eval_every=10", f"train.{key}={value}"])
    # and the same keys pass without emulation, or with evaluation off
    load_config(RECIPES / "digits.toml")
    load_config(RECIPES / "digits.toml", ["train.emulate_compute_s=0.2", "train.eval_every=0"])


def test_labels():
    row = {"strategy": "sync", "nodes": 2, "nodes_total": 2, "num_ps": 1, "gpus_per_node": 2, "data": "real",
           "cell": {"train.emulate_compute_s": "0.2"}, "emulated_compute_s": 0.2}
    assert scaling.setup(row) == "sync, 2 nodes (2 workers x 2 replicas + 1 PS alongside), emulated compute 0.2 s"
    assert "emulated" not in scaling.setup({**row, "emulated_compute_s": 0.0, "cell": {}})
    # an emulated row is not the baseline of a real one
    base = {**row, "strategy": "allreduce", "nodes": 1, "nodes_total": 1, "num_ps": 0, "cell": {},
            "images_per_sec": 10.0}
    assert scaling.baseline({**row, "cell": {}}, [base]) is base
    assert scaling.baseline({**row, "cell": {}, "emulated_compute_s": 0}, [base]) is None


def test_strategies_on_emulated_gpus(tmp_path):
    emulated = [*BASE, f"train.emulate_compute_s={T}"]
    single, w_single = run(tmp_path, "single", *emulated)
    ar, w_ar = run(tmp_path, "allreduce", *emulated, *cluster(2))
    _, w_ar2 = run(tmp_path, "allreduce-again", *emulated, *cluster(2))
    # the sync PS job with its second node slowed: the straggler's delay comes on top of T
    delay = 0.05
    sync, w_sync = run(tmp_path, "sync", *emulated, *cluster(2, 1, "sync"), "strategy.slow_node=1",
                       f"strategy.slow_delay_s={delay}")
    for s, replicas in ((single, 1), (ar, 2), (sync, 2)):
        assert s["emulated_compute_s"] == T and s["replicas"] == replicas and s["steps"] == STEPS
        # every step sleeps T before its strategy step: a lower bound however loaded the machine is
        assert s["train_seconds"] / STEPS >= T and step_seconds(s) >= T, s
        assert s["test_accuracy"] is None and math.isnan(s["final_train_loss"])
        assert s["images_applied"] == STEPS * replicas * BATCH
    assert step_seconds(sync) >= T + delay and sync["train_seconds"] / STEPS >= T + delay
    # the strategies really communicated the gradient
    grad_bytes = 4 * single["parameters"]
    assert ar["bytes_per_step"]["worker_sent"] >= grad_bytes / 2
    assert sync["bytes_per_step"]["worker_sent"] >= grad_bytes and sync["bytes_per_step"]["ps_recv"] >= grad_bytes
    # deterministic: the same job twice gives the same bits
    assert w_ar.keys() == w_ar2.keys() and all(torch.equal(w_ar[k], w_ar2[k]) for k in w_ar)
    # every replica has the same gradient, so averaging it changes nothing: all three agree
    assert max_diff(w_single, w_ar) <= 1e-6 and max_diff(w_single, w_sync) <= 1e-6
    # and the gradient was applied: the weights moved from their initialisation
    cfg = load_config(RECIPES / "digits.toml", emulated)
    torch.manual_seed(cfg.train.seed)
    init = build_model(cfg.model).state_dict()
    assert max_diff({k: w_single[k] for k in w_single if k.endswith("weight")}, init) > 1e-4


def test_no_data_is_read(tmp_path):
    """An emulated run reads no image: files that cannot be decoded do not stop it; a real run of
    the same data stops on the first."""
    for c in ("a", "b"):
        (tmp_path / "data" / c).mkdir(parents=True)
        for i in range(8):
            (tmp_path / "data" / c / f"{i}.jpg").write_bytes(b"not an image")
    data = ["data.name=imagefolder", f"data.root={tmp_path / 'data'}", "model.num_classes=2", "train.steps=3",
            "data.batch_size=4", "data.test_fraction=0.25", "train.eval_every=0", "data.workers=0",
            "train.checkpoint_every=0"]
    s, _ = run(tmp_path, "emulated", *data, "train.emulate_compute_s=0.01")
    assert s["steps"] == 3 and s["skipped_images"] == 0
    assert main(["train", "--recipe", str(RECIPES / "digits.toml"), "--run-dir", str(tmp_path / "real"), "--quiet",
                 *[x for d in data for x in ("--set", d)]]) != 0


def test_bench_adds_emulated_baseline():
    """bench turns evaluation off in every cell, so a recipe that evaluates still benches emulated,
    and its missing baseline is added."""
    from scaletrain.study.bench import baseline_cells

    added = baseline_cells(str(RECIPES / "digits.toml"), ["train.emulate_compute_s=0.1"],
                           [({"cluster.nodes": "2"}, "real")])
    assert added == [({"strategy.name": "allreduce", "cluster.nodes": "1", "cluster.num_ps": "0",
                       "strategy.backup_workers": "0", "strategy.slow_node": "-1"}, "real")]
