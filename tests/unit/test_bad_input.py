"""Bad input a user meets on the command line: each refused in one line naming what is wrong, before any
work starts and before anything is written."""

import os

import pytest

from scaletrain import cli
from scaletrain.config import ConfigError, load_config
from scaletrain.errors import GridError
from scaletrain.study.grid import cells, parse_grid

from conftest import RECIPES


@pytest.mark.parametrize("override", ["optim.lr=nan", "optim.lr=inf", "optim.gamma=-inf", "train.epochs=nan",
                                      "optim.noise_scale=nan"])
def test_float_keys_refuse_nan_and_infinities(override):
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=rf"^{key} = (nan|-?inf): expected a finite number"):
        load_config(RECIPES / "digits.toml", [override])


def test_recipe_nan_is_refused_naming_the_key(tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text("[optim]\nlr = nan\n")
    with pytest.raises(ConfigError, match=r"^optim\.lr = nan"):
        load_config(recipe)


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n# [model]\n"])
def test_empty_recipe_is_refused_naming_the_file(tmp_path, text):
    recipe = tmp_path / "empty.toml"
    recipe.write_text(text)
    with pytest.raises(ConfigError, match=rf"^recipe {recipe} sets nothing"):
        load_config(recipe)


@pytest.mark.parametrize("items", [["cluster.nodes=1,2", "cluster.nodes=3"],
                                   ["cluster.nodes=1,2", "strategy.name+cluster.nodes=sync:1"],
                                   ["cluster.nodes+cluster.nodes=1:2"]])
def test_grid_refuses_a_key_given_twice(items):
    with pytest.raises(GridError, match=r"cluster\.nodes is already in the grid"):
        parse_grid(items)


def test_grid_of_distinct_keys_still_multiplies():
    grid = parse_grid(["cluster.nodes=1,2", "strategy.name+cluster.num_ps=allreduce:0,sync:1"])
    assert len(cells(grid)) == 4


def _refused(capsys, argv) -> str:
    """main's one line on stderr for argv, which it must refuse with exit status 2."""
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("scaletrain: error: ") and err.count("\n") == 1, err
    return err


def test_slurm_wait_needs_submit(tmp_path, capsys):
    run = tmp_path / "run"
    err = _refused(capsys, ["slurm", "--recipe", str(RECIPES / "digits.toml"), "--run-dir", str(run), "--wait"])
    assert "--wait" in err and "--submit" in err and not run.exists()


def test_plan_node_outside_torchrun_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    run = tmp_path / "run"
    err = _refused(capsys, ["train", "--recipe", str(RECIPES / "digits.toml"), "--run-dir", str(run),
                            "--plan-node", "1"])
    assert "--plan-node 1" in err and "torchrun" in err and not run.exists()


def test_unknown_partition_is_refused_before_the_script_is_written(tmp_path, capsys, monkeypatch):
    bin_dir = tmp_path / "bin"  # a sinfo that knows no such partition: it prints nothing, exit status 0
    bin_dir.mkdir()
    (bin_dir / "sinfo").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "sinfo").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    run = tmp_path / "run"
    err = _refused(capsys, ["slurm", "--recipe", str(RECIPES / "digits.toml"), "--run-dir", str(run),
                            "--partition", "nosuch"])
    assert "--partition nosuch" in err and not run.exists()


def test_pack_into_a_folder_of_shards_is_bad_input(tmp_path, capsys):
    out = tmp_path / "shards"
    out.mkdir()
    (out / "index.json").write_text("{}\n")
    err = _refused(capsys, ["pack", "--recipe", str(RECIPES / "digits.toml"), "--set", "data.name=imagefolder",
                            "--set", f"data.root={tmp_path}", "--out", str(out)])
    assert "already holds shards" in err and [p.name for p in out.iterdir()] == ["index.json"]


def test_a_damaged_checkpoint_skipped_on_resume_is_kept_and_the_good_ones_rotate(tmp_path, caplog):
    import torch

    from scaletrain import checkpoint

    d = tmp_path / "ckpt"
    for step in (100, 150):
        checkpoint.save(d, step, {"step": step, "config": {}, "model": {"w": torch.ones(3)}}, keep=2)
    damaged = d / "ckpt-00000150.pt"
    cut = damaged.read_bytes()[:-100]  # truncated
    damaged.write_bytes(cut)
    loaded, _ = checkpoint.load_latest(d)
    assert loaded["step"] == 100 and "kept as ckpt-00000150.pt.damaged" in caplog.text
    for step in (200, 250, 300):  # the resumed run goes on past it
        checkpoint.save(d, step, {"step": step, "config": {}, "model": {"w": torch.ones(3)}}, keep=2)
    assert sorted(p.name for p in d.iterdir()) == ["ckpt-00000150.pt.damaged", "ckpt-00000250.pt",
                                                   "ckpt-00000300.pt"]
    assert (d / "ckpt-00000150.pt.damaged").read_bytes() == cut


def test_a_damaged_checkpoint_of_the_step_being_written_is_kept(tmp_path):
    import torch

    from scaletrain import checkpoint

    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "ckpt-00000010.pt").write_bytes(b"not a checkpoint")
    checkpoint.save(d, 10, {"step": 10, "config": {}, "model": {"w": torch.ones(3)}}, keep=2)
    assert (d / "ckpt-00000010.pt.damaged").read_bytes() == b"not a checkpoint"
    assert checkpoint.read(d / "ckpt-00000010.pt")["step"] == 10
