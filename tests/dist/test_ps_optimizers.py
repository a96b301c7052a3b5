"""lamb applied by a parameter-server shard, with real processes, as one process applies it."""

import json

import torch
from safetensors.torch import load_file

from scaletrain.cli import main

from conftest import RECIPES

LAMB = ["optim.name=lamb", "optim.lr=0.01", "optim.weight_decay=0.01", "optim.schedule=constant",
        "optim.warmup_steps=0", "model.norm=group", "model.width=4", "data.augment=none", "data.workers=0",
        "train.deterministic=true", "train.eval_every=0", "train.log_every=1", "train.warmup_log_steps=0"]
PS = ["cluster.nodes=1", "cluster.gpus_per_node=2", "cluster.num_ps=1", "strategy.name=sync",
      "data.batch_size=8"]


def run(tmp_path, name, *overrides, resume=False):
    run_dir = tmp_path / name
    args = ["train", "--recipe", str(RECIPES / "digits.toml"), "--run-dir", str(run_dir), "--quiet",
            *(["--resume"] if resume else [])]
    for o in [*LAMB, *overrides]:
        args += ["--set", o]
    assert main(args) == 0
    return json.loads((run_dir / "summary.json").read_text()), load_file(str(run_dir / "model.safetensors"))


def max_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_a_ps_shard_steps_lamb_as_one_process(tmp_path):
    """1 PS, 2 workers: the shard's lamb over its flat slice, each layer's piece with its own norms and
    the biases and norms left out, ends where one process's over the same global batch does; its
    checkpoint holds the shard's state (a resume from it: test_optimizers.py, shard by shard)."""
    _, single = run(tmp_path, "single", "data.batch_size=16", "train.steps=4")
    s, ps = run(tmp_path, "ps", *PS, "train.steps=4", "train.checkpoint_every=2")
    assert s["num_ps"] == 1 and s["staleness_max"] == 0
    assert max_diff(single, ps) <= 1e-5
    ckpt = torch.load(tmp_path / "ps" / "checkpoints" / "ckpt-00000002.pt", weights_only=True)["ps"][0]
    assert ckpt["version"] == 2 and set(ckpt["optimizer"]) == {"exp_avg", "exp_avg_sq"}
    assert all(t.shape == ckpt["values"].shape and t.abs().sum() > 0 for t in ckpt["optimizer"].values())
