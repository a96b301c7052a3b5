"""Packing images into shards and reading them back: every epoch sees the manifest's images
and labels, in a (seed, epoch) order; replicas read disjoint stretches; bad images are
found at pack time; resume from shards is exact."""

import io
import json
import subprocess
import tarfile

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from scaletrain.config import build_config
from scaletrain.data import DataError, build_datasets, train_loader
from scaletrain.data.shards import buffer_shuffle, pack, parse_size
from scaletrain.loop import train

from conftest import scaletrain_cmd

CLASSES = ("crying_baby", "happy_baby", "sad_dog")


def colour(i):
    """Sample i's uniform colour: it survives JPEG, resizing and cropping, so a loaded image names its file."""
    return 10 + 5 * i, 128, 128  # JPEG moves R by at most 2


def identity(x: torch.Tensor) -> int:
    """Inverse of colour() from a loaded HWC uint8 image."""
    return round((x[..., 0].float().mean().item() - 10) / 5)


def write_manifest(root, n, size=(60, 45)):
    """n images (JPEG, every fifth PNG) of uniform colours; a manifest with class names."""
    rows = []
    for i in range(n):
        name = f"img/{i}.png" if i % 5 == 0 else f"img/{i}.jpg"
        (root / "img").mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.full((size[1], size[0], 3), colour(i), dtype=np.uint8)).save(root / name)
        rows.append((name, CLASSES[i % 3]))
    (root / "m.csv").write_text("path,label\n" + "".join(f"{p},{c}\n" for p, c in rows))
    return {i: CLASSES.index(c) for i, (_, c) in enumerate(rows)}


def cfg_for(root, **data):
    d = {"name": "manifest", "root": str(root), "image_size": 16, "batch_size": 4, "workers": 0,
         "test_fraction": 0.0, "augment": [], **data}
    return build_config({"model": {"name": "resnet8", "num_classes": 3, "width": 8}, "data": d,
                         "train": {"steps": 6, "log_every": 2, "seed": 3}})


@pytest.fixture()
def packed(tmp_path):
    labels = write_manifest(tmp_path, 48)
    pack(cfg_for(tmp_path / "m.csv"), tmp_path / "shards", shard_bytes=20_000, progress=False)
    return tmp_path / "shards", labels


def epoch_reads(cfg, epochs, world=1, rank=0, seed=None):
    """(identity, label) of every sample a replica's loader yields, per epoch."""
    train_set, _, _ = build_datasets(cfg)
    if seed is not None:
        cfg = cfg.replace(**{"train.seed": seed})
    loader, sampler = train_loader(train_set, cfg, 0, epochs * sampler_steps(train_set, cfg, world), world, rank)
    out = [[] for _ in range(epochs)]
    for step, batch in enumerate(loader):
        out[step // sampler.per_epoch] += [(identity(x), int(y)) for x, y in zip(batch.x, batch.y)]
    return out


def sampler_steps(train_set, cfg, world):
    return len(train_set) // (cfg.data.batch_size * world)


def test_every_epoch_sees_the_manifest_in_a_seeded_order(packed):
    root, labels = packed
    cfg = cfg_for(root, name="shards", workers=1)  # a real loader process reading the shards
    index = json.loads((root / "index.json").read_text())
    assert len(index["splits"]["train"]["shards"]) > 3 and index["splits"]["train"]["samples"] == 48
    assert index["splits"]["train"]["counts"] == {c: 16 for c in CLASSES}
    epochs = epoch_reads(cfg, 3)
    for seen in epochs:
        assert sorted(seen) == sorted(labels.items())  # every image once, with its label
    orders = [[i for i, _ in e] for e in epochs]
    assert len({tuple(o) for o in orders}) == 3  # reshuffled every epoch
    assert epoch_reads(cfg, 3) == epochs  # a function of (seed, epoch)
    assert epoch_reads(cfg, 1, seed=4)[0] != epochs[0]


def test_two_replicas_read_disjoint_halves_of_every_epoch(packed):
    root, labels = packed
    cfg = cfg_for(root, name="shards")
    r0, r1 = epoch_reads(cfg, 2, world=2, rank=0), epoch_reads(cfg, 2, world=2, rank=1)
    for a, b in zip(r0, r1):
        assert len(a) == len(b) == 24 and not {i for i, _ in a} & {i for i, _ in b}
        assert sorted(a + b) == sorted(labels.items())


def test_a_count_that_does_not_divide_leaves_the_rest_out_without_repeats(tmp_path):
    labels = write_manifest(tmp_path, 23)
    pack(cfg_for(tmp_path / "m.csv"), tmp_path / "s", shard_bytes=20_000, progress=False)
    cfg = cfg_for(tmp_path / "s", name="shards")
    for world in (1, 2):
        reads = [epoch_reads(cfg, 2, world, r) for r in range(world)]
        for e in range(2):
            seen = [s for r in reads for s in r[e]]
            assert len(seen) == len(set(seen)) == (23 // (4 * world)) * 4 * world  # 20 (1 replica) or 16 (2)
            assert set(seen) <= set(labels.items())


def test_buffer_shuffle_is_a_permutation_within_its_window():
    seq = np.arange(1000)
    out = buffer_shuffle(seq, 64, np.random.default_rng(0))
    assert sorted(out.tolist()) == seq.tolist() and out.tolist() != seq.tolist()
    assert all(v <= k + 64 for k, v in enumerate(out.tolist()))  # never read ahead of the window


def test_resume_from_shards_with_every_augmentation_is_exact(tmp_path, packed):
    root, _ = packed
    augs = ["resized-crop", "crop", "flip", "rotation", "lens", "vignetting", "color"]
    cfg = cfg_for(root, name="shards", augment=augs, workers=1).replace(
        **{"train.deterministic": True, "train.checkpoint_every": 5, "train.steps": 10})
    train(cfg, tmp_path / "straight", progress=False)
    train(cfg.replace(**{"train.steps": 5}), tmp_path / "split", progress=False)
    train(cfg, tmp_path / "split", resume=True, progress=False)
    a, b = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("straight", "split"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_bad_images_are_found_at_pack_time(tmp_path):
    write_manifest(tmp_path, 12)
    (tmp_path / "img" / "3.jpg").write_bytes(b"\xff\xd8 not a jpeg")
    with pytest.raises(DataError, match=r"img/3\.jpg: cannot read image"):
        pack(cfg_for(tmp_path / "m.csv"), tmp_path / "a", shard_bytes=10**6, progress=False)
    assert not (tmp_path / "a" / "index.json").exists()
    index = pack(cfg_for(tmp_path / "m.csv", on_bad_image="skip"), tmp_path / "b", shard_bytes=10**6,
                 progress=False)
    assert [s["path"].endswith("img/3.jpg") for s in index["skipped"]] == [True]
    assert index["splits"]["train"]["samples"] == 11


def test_pack_command_writes_webdataset_shards(tmp_path, env):
    labels = write_manifest(tmp_path, 30)
    recipe = tmp_path / "r.toml"
    recipe.write_text(f'[model]\nname = "resnet8"\nnum_classes = 3\n[data]\nname = "manifest"\n'
                      f'root = "{tmp_path / "m.csv"}"\ntest_fraction = 0.2\n')
    out = subprocess.run(scaletrain_cmd("pack", "--recipe", str(recipe), "--shard-size", "16KB",
                                        "--out", str(tmp_path / "s")), capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert "packed image 30/30" in out.stdout  # progress, as lines when not on a terminal
    assert "packed 24 training and 6 test images of 3 classes" in out.stdout
    sources = {}
    for tar_path in sorted((tmp_path / "s").glob("*.tar")):
        with tarfile.open(tar_path) as tar:
            members = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
        for name, data in members.items():
            if name.endswith(".cls"):
                img = next(v for k, v in members.items() if k.startswith(name[:-3]) and not k.endswith(".cls"))
                x = torch.from_numpy(np.array(Image.open(io.BytesIO(img)).convert("RGB")))
                sources[identity(x)] = int(data)
    assert sources == labels  # every image, with its label, as webdataset would read it
    again = subprocess.run(scaletrain_cmd("pack", "--recipe", str(recipe), "--out", str(tmp_path / "s")),
                           capture_output=True, text=True, env=env)
    assert again.returncode == 2 and "already holds shards" in again.stderr  # bad input: another --out
    bad = subprocess.run(scaletrain_cmd("pack", "--recipe", str(recipe), "--shard-size", "lots", "--out",
                                        str(tmp_path / "t")), capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--shard-size 'lots' is not a size" in bad.stderr


def pack_recipe(tmp_path):
    write_manifest(tmp_path, 6)
    recipe = tmp_path / "r.toml"
    recipe.write_text(f'[data]\nname = "manifest"\nroot = "{tmp_path / "m.csv"}"\n')
    return str(recipe)


def test_pack_out_that_is_a_file_is_refused(tmp_path, capsys):
    from scaletrain.cli import main

    a_file = tmp_path / "x.tar"
    a_file.write_bytes(b"mine")
    assert main(["pack", "--recipe", pack_recipe(tmp_path), "--quiet", "--out", str(a_file)]) == 2
    assert capsys.readouterr().err == f"scaletrain: error: --out {a_file} is a file, not a directory\n"
    assert a_file.read_bytes() == b"mine"


def test_pack_out_holding_other_files_is_refused(tmp_path, capsys):
    from scaletrain.cli import main

    recipe = pack_recipe(tmp_path)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    (busy / "index.json.bak").write_text("{}")
    assert main(["pack", "--recipe", recipe, "--quiet", "--out", str(busy)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"scaletrain: error: --out {busy} holds 2 files that are not shards") and \
        err.count("\n") == 1 and "give a new or empty directory" in err, err
    assert sorted(p.name for p in busy.iterdir()) == ["index.json.bak", "notes.txt"]


def test_parse_size():
    assert parse_size("1GB") == 10**9 and parse_size("256MiB") == 2**28 and parse_size("1000") == 1000
    with pytest.raises(ValueError):
        parse_size("-1GB")


def test_missing_or_unfinished_pack_is_named(tmp_path, packed):
    with pytest.raises(DataError, match=r"has no index.json; write shards with scaletrain pack"):
        build_datasets(cfg_for(tmp_path / "nothing", name="shards"))
    root, _ = packed
    next(root.glob("train-*.tar")).unlink()
    with pytest.raises(DataError, match=r"shard .*train-0000\d\d\.tar is missing"):
        build_datasets(cfg_for(root, name="shards"))
