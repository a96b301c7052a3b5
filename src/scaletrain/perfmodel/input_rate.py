"""The input rate calibrate measures: images/s one loader core delivers from the recipe's own files.

One process, one torch thread, no loader processes, calling what a loader process calls (the
recipe's loader.Samples, then collate) on files already read once: the page cache's, so the figure
is the CPU's work (read, decode, augment), not the disk's. Recipes whose data is not read from files
(digits, synthetic), or whose data.root is not on this machine, have none: input_unmeasured says why.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from ..config import Config
from ..data.augment import ON_DEVICE, Augment
from ..data.build import build_datasets
from ..data.loader import Samples, ShardedBatches, collate
from ..errors import ProfileError

# The data sources read from files, and how calibrate names them.
FILE_SOURCES = {"imagefolder": "image folder", "manifest": "manifest", "shards": "packed shards"}
# Images timed a round, after a warm-up. 64 span files of different sizes (a decode costs per byte)
# and take a fraction of a second at the hundreds of img/s a core decodes at 224 px: little next to
# a round's training jobs, and each round times them again. The warm-up's 8 pay for what a first
# call does once (the decoder's set-up, the allocator's first pages). Fewer training images: all.
INPUT_IMAGES, INPUT_WARMUP = 64, 8


def input_unmeasured(cfg: Config) -> str | None:
    """Why the input rate of cfg's data cannot be measured here, in words; None when it can."""
    d = cfg.data
    if d.name not in FILE_SOURCES:
        return f"data.name = {d.name!r} is not read from image files (imagefolder, manifest and shards are)"
    if not d.root:
        return "data.root is not set"
    if not Path(d.root).exists():
        return f"data.root {d.root} does not exist on this machine"
    return None


def input_text(cfg: Config) -> str:
    """'/data/anp (image folder, 224 px, resized-crop + flip)': what the input figure is of. The
    augmentations that run on the device are not a loader core's work, nor, with data.decode =
    device, is the decode."""
    d = cfg.data
    loader = [a for a in d.augment if a not in ON_DEVICE]
    device = [a for a in d.augment if a in ON_DEVICE]
    parts = [FILE_SOURCES[d.name], f"{d.image_size} px", " + ".join(loader) or "no augmentation"]
    if device:
        parts.append(f"{' + '.join(device)} on the device, not timed")
    if d.decode == "device":
        parts.append("decoded on the device: the loader reads the files")
    return f"{d.root} ({', '.join(parts)})"


def input_measure(cfg: Config, images: int = INPUT_IMAGES, warmup: int = INPUT_WARMUP):
    """A measure (rounds) of the images/s one loader core delivers from cfg's training set: one
    process, one torch thread, no loader processes, calling what a loader process calls (the
    recipe's loader.Samples: its augmentations, image_size and decode; then collate, in batches of
    data.batch_size) on `images` of epoch 1's order, after `warmup` of epoch 0's (different draws,
    as the next epoch's). The training set is listed once, not once a round: a manifest or folder
    of a million files takes seconds to list. Before the clock starts the timed files are read
    once, so that every round times the CPU's work on files in the page cache: the disk's rate is
    not in the figure. Raises ProfileError naming why the data cannot be measured here."""
    why = input_unmeasured(cfg)
    if why:
        raise ProfileError(f"calibrate: no input rate: {why}")
    d, seed = cfg.data, cfg.train.seed
    train = build_datasets(cfg, check=False)[0]  # a manifest's files are found or not as they are read
    samples = Samples(train, d.image_size, Augment(d.augment, seed) if d.augment else None,
                      encoded=d.decode == "device")
    n, order = len(train), getattr(train, "epoch_order", None)

    def keys(epoch: int, count: int) -> list[tuple[int, int]]:  # the epoch's first images, as one replica reads them
        return [k for b in ShardedBatches(n, 1, seed=seed, start=epoch * n, stop=epoch * n + min(count, n),
                                          order=order) for k in b]
    warm, timed = keys(0, warmup), keys(1, images)

    def measure() -> dict[str, float]:
        torch.set_num_threads(1)  # one loader core: a loader process runs one thread (loader._loader_setup)
        deliver(samples, warm, d.batch_size, d.on_bad_image)
        for i, _ in timed:
            train[i]  # into the page cache
        t0 = time.perf_counter()
        good = deliver(samples, timed, d.batch_size, d.on_bad_image)
        return {"images_per_s": good / (time.perf_counter() - t0), "images": len(timed)}
    return measure


def deliver(samples: Samples, keys: list, batch: int, on_bad: str) -> int:
    """The images a loader process delivers for `keys`, in batches: Samples per key, then collate.
    A bad image stops the calibration where it would stop training (data.on_bad_image = error)."""
    good = 0
    for lo in range(0, len(keys), batch):
        b = collate([samples[k] for k in keys[lo:lo + batch]])
        if b.bad and on_bad == "error":
            raise ProfileError(f"calibrate: input: {b.bad[0].path}: {b.bad[0].reason}")
        good += len(b.y)
    if not good:
        raise ProfileError(f"calibrate: input: none of {len(keys)} images could be read")
    return good
