"""The average of the weights (train.ema_decay, ema.py): its closed form, a resume that keeps it,
and a two-process run that reports its accuracy and exports it."""

import json

import pytest
import torch
from safetensors.torch import load_file

from scaletrain.cli import main
from scaletrain.ema import Ema
from scaletrain.loop import train

from conftest import RECIPES


def test_average_after_k_updates_is_the_closed_form():
    """ema_k = prod(d_i) w_0 + sum_i (1 - d_i) prod_{j>i} d_j w_i, d_i = min(decay, (1 + i) / (10 + i)):
    the warm-up's rates first, then the decay; buffers are the weights' own, copied."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    ema, decay = Ema(0.3, model), 0.3
    seen = [model[0].weight.detach().clone()]
    for _ in range(7):
        with torch.no_grad():
            model[0].weight.add_(torch.randn(4, 3))
        model(torch.randn(5, 3))  # training mode: BatchNorm's running statistics move
        ema.update()
        seen.append(model[0].weight.detach().clone())
    rates = [min(decay, (1 + i) / (10 + i)) for i in range(7)]
    assert rates[0] == pytest.approx(0.1) and rates[-1] == decay  # both regimes are in the 7 updates
    expected = seen[0] * torch.tensor(rates).prod()
    for i in range(7):
        expected = expected + (1 - rates[i]) * torch.tensor(rates[i + 1:]).prod() * seen[i + 1]
    saved = ema.state_dict()["tensors"]
    torch.testing.assert_close(saved["0.weight"], expected)
    assert torch.equal(saved["1.running_mean"], model[1].running_mean)
    assert saved.keys() == model.state_dict().keys()
    with ema.swapped():  # evaluation sees the average in the model, then the weights are back
        torch.testing.assert_close(model[0].weight.detach(), expected)
    assert torch.equal(model[0].weight.detach(), seen[-1])


def test_resumed_average_equals_an_uninterrupted_ones(digits_cfg, tmp_path):
    cfg = digits_cfg("train.steps=4", "train.loggers=[]", "optim.schedule=step", "optim.step_size=2",
                     "optim.warmup_steps=2", "train.checkpoint_every=2", "train.eval_every=0", "train.ema_decay=0.9")
    train(cfg, tmp_path / "straight", progress=False)
    train(cfg.replace(**{"train.steps": 2}), tmp_path / "resumed", progress=False)
    s = train(cfg, tmp_path / "resumed", resume=True, progress=False)
    assert s["start_step"] == 2 and s["ema_updates"] == 4
    a = load_file(str(tmp_path / "straight" / "model-ema.safetensors"))
    b = load_file(str(tmp_path / "resumed" / "model-ema.safetensors"))
    assert a.keys() == load_file(str(tmp_path / "straight" / "model.safetensors")).keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_two_replicas_report_the_averages_accuracy_beside_the_weights(tmp_path):
    run = tmp_path / "r"
    keys = ["cluster.nodes=2", "strategy.name=allreduce", "cluster.num_ps=0", "data.workers=0", "train.steps=4",
            "train.eval_every=2", "train.checkpoint_every=0", "train.ema_decay=0.99", "train.loggers=[]"]
    rc = main(["train", "--recipe", str(RECIPES / "digits.toml"), "--run-dir", str(run), "--quiet",
               *[a for k in keys for a in ("--set", k)]])
    assert rc == 0
    summary = json.loads((run / "summary.json").read_text())
    assert 0.0 <= summary["test_accuracy_ema"] <= 1.0 and summary["ema_updates"] == 4
    evals = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in evals if r.get("kind") == "eval"]
    assert len(evals) == 2 and all("test_accuracy_ema" in r and "test_accuracy" in r for r in evals)
    weights, average = load_file(str(run / "model.safetensors")), load_file(str(run / "model-ema.safetensors"))
    assert weights.keys() == average.keys() and not torch.equal(weights["fc.weight"], average["fc.weight"])
