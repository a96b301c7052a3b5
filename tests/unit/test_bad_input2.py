"""Bad input met while a job runs: a file among the images that is not one, a disk the last
checkpoint does not fit on, and the figures of a job resumed part way."""

import errno
import os
import subprocess

import pytest

from scaletrain.api import train
from scaletrain.checkpoint import RESERVE, Writer
from scaletrain.data import DataError

from conftest import write_images


def test_a_text_file_among_the_images_is_named_by_its_path(tmp_path, digits_cfg):
    root = tmp_path / "images"
    write_images(root, per_class=4)
    bad = root / "sad_dog" / "x.jpg"
    bad.write_text("a note, not an image\n")
    # test_root = root and one batch of all 13 files: the text file is read at the first step
    cfg = digits_cfg("data.name='imagefolder'", f"data.root='{root}'", f"data.test_root='{root}'",
                     "model.num_classes=3", "data.batch_size=13", "train.steps=1")
    with pytest.raises(DataError) as e:
        train(cfg, run_dir=tmp_path / "run", progress=False)
    line = str(e.value)
    assert line.startswith(f"{bad}: cannot read image (UnidentifiedImageError: not an image of a format Pillow "
                           "reads"), line
    assert "BytesIO" not in line and "\n" not in line


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")


@pytest.fixture
def small_disk(tmp_path):
    d = tmp_path / "disk"
    d.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(d)], check=True)
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False)


def fill_up(d):
    """Take every free byte of d's file system."""
    with open(d / "filler", "wb", buffering=0) as fh:
        try:
            while True:
                fh.write(bytes(4096))
        except OSError as e:
            assert e.errno == errno.ENOSPC


@needs_root
def test_a_last_checkpoint_on_a_full_disk_leaves_room_for_the_jobs_last_words(small_disk):
    """A checkpoint that does not fit while training goes on keeps the writer's reserve; the last one
    gives it back, so that the processes' notes and the launcher's record of who failed can be written
    (without it, peers and launcher took the chief for a frozen process, or the launcher failed)."""
    ckpts = small_disk / "run" / "checkpoints"
    w = Writer(ckpts, keep=2)
    w.submit(1, {"step": 1, "w": list(range(10))})  # small: it fits, and takes the reserve first
    w.join()
    assert w.failed is None and (ckpts / RESERVE).exists()
    fill_up(small_disk)
    big = {"step": 2, "w": bytes(300_000)}
    w.submit(2, big)
    w.join()
    assert "No space left on device" in w.failed and (ckpts / RESERVE).exists()  # training goes on
    w.submit(3, {**big, "step": 3}, final=True)
    w.join()
    assert f"{ckpts / 'ckpt-00000003.pt'}: cannot write the checkpoint (No space left on device)" in w.failed
    assert not (ckpts / RESERVE).exists()
    (small_disk / "run" / "failure.json").write_text('{"rank": 0, "what": "..."}\n' * 100)  # the room is there
    assert sorted(p.name for p in ckpts.iterdir()) == ["ckpt-00000001.pt"]  # the complete one is kept


def test_a_resumed_job_counts_every_image_it_applied_and_times_its_part(tmp_path, digits_cfg):
    run = tmp_path / "run"
    part = ["train.log_every=1", "train.warmup_log_steps=0", "train.eval_every=0", "train.checkpoint_every=2"]
    first = train(digits_cfg("train.steps=2", *part), run_dir=run, progress=False)
    assert first["images_applied"] == first["part_images_applied"] == 2 * 32
    second = train(digits_cfg("train.steps=4", *part), run_dir=run, resume=True, progress=False)
    assert second["start_step"] == 2 and second["steps"] == 4
    assert second["images_applied"] == 4 * 32 * 1  # steps x batch x replicas: the whole job's
    assert second["part_images_applied"] == 2 * 32  # what this part's clock timed
    assert second["images_per_sec"] * second["train_seconds"] == pytest.approx(2 * 32, rel=1e-6)
