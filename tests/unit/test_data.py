import json
import re
import subprocess

import pytest
import torch

from scaletrain.config import build_config
from scaletrain.data import BadImage, DataError, ShardedBatches, build_datasets, train_loader
from scaletrain.data.loader import Samples
from scaletrain.loop import train

from conftest import scaletrain_cmd, write_images


def cfg_for(name, root, **extra):
    data = {"name": name, "root": str(root), "image_size": 16, "batch_size": 4, "workers": 0,
            "test_fraction": 0.25, **extra}
    return build_config({"model": {"name": "resnet8", "num_classes": 3, "width": 8}, "data": data,
                         "train": {"steps": 3, "log_every": 1}})


def test_imagefolder_loads_sorted_classes(tmp_path):
    write_images(tmp_path)
    tr, te, classes = build_datasets(cfg_for("imagefolder", tmp_path))
    assert classes == ["crying_baby", "happy_baby", "sad_dog"]
    assert len(tr) + len(te) == 12 and len(te) == 3
    x, y, _ = Samples(tr, 16)[0]
    assert x.shape == (16, 16, 3) and x.dtype == torch.uint8 and 0 <= y < 3


def test_manifest_with_names_and_indices(tmp_path):
    rows = write_images(tmp_path)
    (tmp_path / "m.csv").write_text("path,label\n" + "".join(f"{p},{c}\n" for p, c in rows))
    tr, te, classes = build_datasets(cfg_for("manifest", tmp_path / "m.csv"))
    assert classes == ["crying_baby", "happy_baby", "sad_dog"] and len(tr) == 9
    (tmp_path / "i.csv").write_text("".join(f"{p},{i % 3}\n" for i, (p, _) in enumerate(rows)))
    tr, _, _ = build_datasets(cfg_for("manifest", tmp_path / "i.csv", test_fraction=0.0))
    assert sorted(tr.labels) == sorted(i % 3 for i in range(12))


def test_out_of_range_label_named_with_line(tmp_path):
    rows = write_images(tmp_path)
    (tmp_path / "m.csv").write_text("path,label\n" + "".join(f"{p},{i % 3}\n" for i, (p, _) in enumerate(rows))
                                    + f"{rows[0][0]},3\n")
    with pytest.raises(DataError, match=r"m\.csv line 14: label '3' is outside \[0, 3\)"):
        build_datasets(cfg_for("manifest", tmp_path / "m.csv"))
    write_images(tmp_path / "four", classes=("a", "b", "c", "d"), per_class=1)
    with pytest.raises(DataError, match=r"four/d: class index 3 is outside \[0, 3\)"):
        build_datasets(cfg_for("imagefolder", tmp_path / "four"))


def test_missing_file_and_directory_named(tmp_path):
    rows = write_images(tmp_path)
    (tmp_path / "m.csv").write_text("".join(f"{p},{c}\n" for p, c in rows) + "nothere.jpg,sad_dog\n")
    with pytest.raises(DataError, match=r"m\.csv line 13: image .*nothere\.jpg does not exist"):
        build_datasets(cfg_for("manifest", tmp_path / "m.csv"))
    with pytest.raises(DataError, match=r"directory .*absent does not exist"):
        build_datasets(cfg_for("imagefolder", tmp_path / "absent"))


@pytest.mark.parametrize("nodes", [1, 2])
def test_a_data_error_leaves_no_run_directory(tmp_path, capsys, nodes):
    """Refused before anything is written: neither the run directory nor a parent the command would
    have made is left behind; one the user made is kept as it was. With 2 nodes the launcher checks
    before it starts any process."""
    from scaletrain.cli import main

    from conftest import RECIPES

    rows = write_images(tmp_path / "images")
    (tmp_path / "m.csv").write_text("".join(f"images/{p},{c}\n" for p, c in rows) + "nothere.jpg,sad_dog\n")
    (tmp_path / "mine").mkdir()
    cases = [(tmp_path / "new" / "run", "data.name=imagefolder", f"data.root={tmp_path / 'absent'}",
              "directory .*absent does not exist"),
             (tmp_path / "mine", "data.name=manifest", f"data.root={tmp_path / 'm.csv'}",
              r"m\.csv line 13: image .*nothere\.jpg does not exist")]
    for run_dir, name, root, says in cases:
        rc = main(["train", "--recipe", str(RECIPES / "digits.toml"), "--run-dir", str(run_dir), "--quiet",
                   "--set", name, "--set", root, "--set", "model.num_classes=3", "--set", "data.workers=0",
                   "--set", f"cluster.nodes={nodes}"])
        err = capsys.readouterr().err
        assert rc == 1, err
        [line] = [x for x in err.splitlines() if x.startswith("scaletrain")]
        assert re.search(says, line), line
    assert not (tmp_path / "new").exists()
    assert (tmp_path / "mine").is_dir() and not list((tmp_path / "mine").iterdir())


def test_manifest_files_checked_once_and_again_when_it_changes(tmp_path):
    """The check of a manifest's files is recorded in the run directory and stands while the manifest
    is unchanged: a file deleted since is not looked for at start-up but named when it is read."""
    rows = write_images(tmp_path / "data")
    m = tmp_path / "data" / "m.csv"
    m.write_text("".join(f"{p},{c}\n" for p, c in rows))
    cfg, run = cfg_for("manifest", m), tmp_path / "run"
    build_datasets(cfg, run)
    record = run / "logs" / "manifest-checked.json"
    made = record.stat().st_mtime_ns
    gone = tmp_path / "data" / rows[5][0]
    gone.unlink()
    tr, te, _ = build_datasets(cfg, run)  # no stat a row: the record stands for this manifest
    assert record.stat().st_mtime_ns == made
    ds = tr if str(gone) in tr.paths else te
    bad = Samples(ds, 16)[ds.paths.index(str(gone))]
    assert isinstance(bad, BadImage) and bad.path == str(gone) and bad.reason.startswith("FileNotFoundError")
    build_datasets(cfg, check=False)  # a process that is not the chief never looks
    m.write_text(m.read_text() + f"{rows[0][0]},{rows[0][1]}\n")  # a changed manifest is checked again
    with pytest.raises(DataError, match=rf"m\.csv line 6: image .*{re.escape(rows[5][0])} does not exist"):
        build_datasets(cfg, run)


def corrupt_folder(tmp_path):
    write_images(tmp_path, per_class=4)
    bad = tmp_path / "sad_dog" / "9.jpg"
    bad.write_bytes(b"this is not a jpeg")
    return bad


def test_corrupt_image_stops_run_naming_file(tmp_path, env):
    bad = corrupt_folder(tmp_path / "data")
    # test_root == root: every image, the corrupt one too, is read in the first steps
    p = subprocess.run(scaletrain_cmd("train", "--recipe", "recipes/digits.toml", "--quiet",
                                      "--set", "data.name=imagefolder", "--set", f"data.root={tmp_path / 'data'}",
                                      "--set", f"data.test_root={tmp_path / 'data'}", "--set", "model.num_classes=3",
                                      "--set", "data.batch_size=13", "--set", "train.steps=1",
                                      "--set", "data.workers=1", "--run-dir", str(tmp_path / "run")),
                       capture_output=True, text=True, env=env)
    assert p.returncode == 1, p.stderr
    assert f"{bad}: cannot read image" in p.stderr and "Traceback" not in p.stderr


def test_corrupt_image_skipped_and_counted(tmp_path):
    bad = corrupt_folder(tmp_path / "data")
    cfg = cfg_for("imagefolder", tmp_path / "data", on_bad_image="skip", test_root=str(tmp_path / "data"),
                  batch_size=13, workers=1)
    s = train(cfg.replace(**{"train.steps": 2}), tmp_path / "run", progress=False)
    assert s["skipped_images"] == 1 and s["skipped_files"] == [str(bad)]
    assert s["test_images"] == 13 and json.loads((tmp_path / "run" / "summary.json").read_text())["skipped_images"] == 1


@pytest.mark.parametrize("world, batch", [(2, 3), (4, 2), (3, 5)])
def test_sampler_union_of_replicas_is_the_single_batch(world, batch):
    n = 101
    single = ShardedBatches(n, world * batch, 1, 0, seed=7)
    shards = [ShardedBatches(n, batch, world, r, seed=7) for r in range(world)]
    assert single.per_epoch == shards[0].per_epoch
    for step in range(3 * single.per_epoch):  # several epochs, reshuffled each
        union = [i for s in shards for i in s.indices(step)]
        assert union == single.indices(step)
        assert len(set(union)) == world * batch


def test_loaded_replica_batches_equal_the_single_batch_with_augmentation(digits_cfg):
    world, b = 2, 8
    one = digits_cfg(f"data.batch_size={world * b}", "data.augment=crop+flip", "data.workers=1")
    shard = one.replace(**{"data.batch_size": b})
    tr, _, _ = build_datasets(one)
    single, _ = train_loader(tr, one, start=3, stop=6)
    replicas = [train_loader(tr, shard, start=3, stop=6, world=world, rank=r)[0] for r in range(world)]
    for big, *parts in zip(single, *replicas):
        assert torch.equal(big.x, torch.cat([p.x for p in parts]))
        assert torch.equal(big.y, torch.cat([p.y for p in parts]))
