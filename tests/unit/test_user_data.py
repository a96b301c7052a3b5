"""A user's dataset named by import path (data.name = "user_data:FACTORY", tests/user_data.py):
both return forms, the built-in path its samples take, and every way it can be wrong, named in
one line before any process starts."""

import re

import pytest
import torch

from scaletrain.cli import main
from scaletrain.config import build_config, dump_toml, load_config
from scaletrain.data import BadImage, build_datasets, check_data, train_loader
from scaletrain.data.augment import centre
from scaletrain.data.decode import fit
from scaletrain.data.loader import Samples
from scaletrain.data.sources import IMAGENET, held_out
from scaletrain.errors import ConfigError

from conftest import RECIPES


def test_a_dataset_has_its_test_split_held_out_as_a_manifests(digits_cfg):
    cfg = digits_cfg("data.name=user_data:digits", "data.args={count = 300}", "data.test_fraction=0.2")
    tr, te, classes = build_datasets(cfg)
    train_at, test_at = held_out(300, 0.2)
    assert len(tr) == 240 and len(te) == 60
    assert list(te.positions) == list(test_at) and list(tr.positions) == list(train_at)
    assert classes == [f"digit {i}" for i in range(10)] and tr.stats == IMAGENET
    assert te.name(0) == f"user_data:digits sample {test_at[0]}"
    # a 1 x 8 x 8 float image: grey repeated to RGB, resized to the input as every source's is
    x, y, _ = Samples(tr, 16)[0]
    img, lab = tr.base[int(train_at[0])]
    assert x.shape == (16, 16, 3) and x.dtype == torch.uint8 and y == lab
    grey = (img * 255).round().to(torch.uint8).permute(1, 2, 0).expand(-1, -1, 3)
    assert torch.equal(x, fit(grey, centre(8, 8), 16))


def test_a_tuple_gives_its_own_split_classes_and_stats(digits_cfg):
    cfg = digits_cfg("data.name=user_data:digits_split", "data.args={count = 300, test = 50, stats = true}")
    tr, te, classes = build_datasets(cfg)
    assert (len(tr), len(te)) == (250, 50) and classes == [str(i) for i in range(10)]
    assert tr.stats == te.stats == ((0.3,) * 3, (0.4,) * 3)
    assert te.name(3) == "user_data:digits_split test sample 3"
    # an 8 x 10 x 3 array: its centre square is the digit
    x, y, _ = Samples(te, 8)[3]
    img, lab = te.base[3]
    assert torch.equal(x, torch.from_numpy(img[:, 1:9])) and y == int(lab)


@pytest.mark.parametrize("name", ["digits", "digits_split"])
def test_replica_batches_of_a_users_dataset_are_the_single_batch(digits_cfg, name):
    world, b = 2, 8
    one = digits_cfg(f"data.name=user_data:{name}", "data.args={count = 200}", f"data.batch_size={world * b}",
                     "data.augment=crop+flip", "data.workers=1")
    shard = one.replace(**{"data.batch_size": b})
    tr, _, _ = build_datasets(one)
    single, _ = train_loader(tr, one, start=3, stop=20)  # past the first epoch (8 or 6 steps): reshuffled
    replicas = [train_loader(tr, shard, start=3, stop=20, world=world, rank=r)[0] for r in range(world)]
    n = 0
    for big, *parts in zip(single, *replicas):
        assert torch.equal(big.x, torch.cat([p.x for p in parts]))
        assert torch.equal(big.y, torch.cat([p.y for p in parts]))
        assert not big.bad
        n += 1
    assert n == 17


BAD = [
    ("no_such_module_here:make", r"data\.name = 'no_such_module_here:make': module no_such_module_here does not "
     r"import: ModuleNotFoundError: No module named 'no_such_module_here'"),
    ("user_data:nothere", r"data\.name = 'user_data:nothere': module user_data has no attribute 'nothere'"),
    ("user_data:NOT_A_FUNCTION", r"'user_data:NOT_A_FUNCTION': an object of type int is not callable"),
    ("user_data:raises", r"'user_data:raises': the factory raised FileNotFoundError: /data/gone "
     r"\(data\.args = \{'message': '/data/gone'\}\)"),
    ("user_data:number", r"'user_data:number': the factory returned an object of type int; expected a "
     r"torch\.utils\.data\.Dataset of \(image, label\) or a tuple \(train, test, classes\)"),
    ("user_data:stream", r"'user_data:stream': the dataset is an object of type user_data\.stream\.<locals>\.Stream; "
     r"expected a map-style torch\.utils\.data\.Dataset"),
    ("user_data:flat_images", r"'user_data:flat_images': training sample \d+: image is a torch\.float64 tensor of "
     r"shape \(8, 8\); expected a C x H x W torch tensor"),
    ("user_data:unscaled", r"training sample \d+: image is a torch\.float32 tensor of shape \(3, 8, 8\) with values "
     r"in \[255, 255\]; expected floats in \[0, 1\]"),
    ("user_data:triples", r"training sample \d+: it is a tuple of 3; expected \(image, label\)"),
    ("user_data:label_twelve", r"'user_data:label_twelve': training sample \d+: label 12 is outside \[0, 10\) "
     r"\(model\.num_classes = 10\)"),
]


@pytest.mark.parametrize("name,says", BAD, ids=[n.split(":")[1] for n, _ in BAD])
def test_a_bad_users_dataset_is_named_in_one_line_before_any_process_starts(tmp_path, capsys, name, says):
    """From the CLI, exit status 2 with one line; with 2 nodes the launcher finds it before it starts
    a process or makes the run directory."""
    sets = [f"data.name={name}", "cluster.nodes=2", "data.workers=0"]
    if name.endswith(":raises"):
        sets.append("data.args={message = '/data/gone'}")
    cfg = build_config({"model": {"num_classes": 10}}, sets)
    with pytest.raises(ConfigError) as e:
        check_data(cfg)
    assert re.search(says, str(e.value)) and "\n" not in str(e.value), str(e.value)
    run_dir = tmp_path / "run"
    args = ["train", "--recipe", str(RECIPES / "digits.toml"), "--run-dir", str(run_dir), "--quiet"]
    assert main([*args, *(a for s in sets for a in ("--set", s))]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(says, err[0]), err
    assert not run_dir.exists()


def test_a_single_process_run_names_a_bad_dataset_the_same_way(tmp_path, capsys):
    args = ["train", "--recipe", str(RECIPES / "digits.toml"), "--run-dir", str(tmp_path / "run"), "--quiet",
            "--set", "data.name=user_data:label_twelve", "--set", "data.workers=0"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "training sample" in err[0] and "label 12 is outside [0, 10)" in err[0], err
    assert not (tmp_path / "run").exists()


def test_a_bad_sample_found_later_is_a_bad_image_naming_it(digits_cfg):
    """Only the first sample of each split is read at start-up; any other is checked as it is read,
    and takes data.on_bad_image's path as an unreadable file does."""
    tr, te, _ = build_datasets(digits_cfg("data.name=user_data:bad_at", "data.args={position = 7}"))
    ds = tr if 7 in list(tr.positions) else te
    bad = Samples(ds, 16)[list(ds.positions).index(7)]
    assert isinstance(bad, BadImage)
    assert bad.path == "user_data:bad_at sample 7" and bad.reason.startswith("ValueError: label 12 is outside [0, 10)")


@pytest.mark.parametrize("sets,says", [
    (["data.name=user_data"], r"data\.name = 'user_data': not a dataset; choose one of digits, synthetic, "
     r"imagefolder, manifest, shards, or a factory of your own as package\.module:factory"),
    (["data.args={count = 3}"], r"data\.args = \{'count': 3\}: the keyword arguments of a factory .*; "
     r"data\.name = 'digits' takes none"),
    (["data.name=user_data:digits", "data.root=/data"], r"data\.root = '/data': data\.name = 'user_data:digits' "
     r"reads no files of its own; give the factory its paths in \[data\.args\]"),
    (["data.args=3"], r"data\.args = 3: expected dict"),
])
def test_data_name_and_args_are_checked_with_the_config(sets, says):
    with pytest.raises(ConfigError, match=says):
        build_config({}, sets)


def test_data_args_is_a_recipe_table(tmp_path, capsys):
    recipe = tmp_path / "r.toml"
    recipe.write_text('[data]\nname = "user_data:digits_split"\n[data.args]\ncount = 300\ntest = 50\n')
    cfg = load_config(recipe)
    assert cfg.data.args == {"count": 300, "test": 50}
    (tmp_path / "again.toml").write_text(dump_toml(cfg))  # a run's config.toml reads back the same
    assert load_config(tmp_path / "again.toml") == cfg
    assert main(["keys"]) == 0
    assert re.search(r"data\.args +data\.name = package\.module:factory: the factory's keyword arguments",
                     capsys.readouterr().out)
