"""Input pipeline images/s per loader core: decode, crop and augmentation, from files and from shards.

Writes --count JPEGs made from real photographs (random 4:3 crops of scikit-learn's
china.jpg and flower.jpg, resized with Lanczos to 500x375, ImageNet's most common size,
half of them mirrored, saved by Pillow at quality 90) into an image folder. The files
are ~52 KB, half ImageNet's mean, as the two scenes are smooth; a decode spends part of
its time per byte, so ImageNet's files may cost somewhat more (the JSON gives the size,
and Pillow's decode rate for comparison). It packs them into
shards (scaletrain.data.shards.pack) and times one core's work: one process, one torch
thread, no loader processes; the dataset and collate are called directly, so images/s is
what one loader process adds. Files and shards are in the page cache: this is CPU work,
not disk. Rows, all at --size:

  before              the previous path (a copy of it, here): Pillow decode, shorter side
                      resized (bilinear), centre crop, float32 normalised per image, then
                      pad-and-crop and flip on the floats; collated into float batches
  pillow_decode_only  Pillow's decode alone (open + load), for reference
  files               loader.Samples over sources.FileDataset + loader.collate, batches of
                      --batch, per augmentation set (none, each alone, the usual
                      resized-crop+flip, all)
  shards              the same over a ShardDataset, in one replica's epoch_order
  device              loader.Prepare (uint8 -> float, the device's augmentations,
                      normalisation) per image, in seconds, on --device

Repeats run round-robin over the rows so a change in machine load hits all of them; each
repeat is one epoch (a new epoch's draws) after a warm-up of --warmup batches. Figures are
the median and every repeat. cores_per_replica is a model's images/s over the per-core
rate of resized-crop+flip: the loader processes one replica needs to keep the model fed.
same_picture compares the new path's normalised centre crops with the previous path's
(different resize kernels, so close but not equal). Prints one JSON object.

    python benchmarks/input.py [--count 256 --size 224 --batch 32 --repeats 5 --model-rate 2500]
    python benchmarks/input.py --quick     # 32 images, one repeat: a smoke run
    python benchmarks/input.py --save      # also benchmarks/results/input-<UTC time>-<short commit>.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from scaletrain.config import build_config
from scaletrain.recipe_values import AUGMENTATIONS
from scaletrain.data.augment import ON_DEVICE, Augment
from scaletrain.data.loader import Prepare, Samples, ShardedBatches, collate
from scaletrain.data.shards import open_shards, pack
from scaletrain.data.sources import IMAGENET, FileDataset, scan_folder
from scaletrain.metrics import git_commit, run_info, sync

ROOT = Path(__file__).resolve().parents[1]
WIDTH, HEIGHT, QUALITY, CLASSES = 500, 375, 90, 4
PHOTOS = ("china.jpg", "flower.jpg")
SEED = 0
K80_RATE = 31.0  # ResNet-50 images/s of one K80 die: the study's GPU


def write_images(root: Path, count: int) -> dict:
    """`count` distinct JPEGs under root/classK/, and what they are."""
    from PIL import Image
    from sklearn.datasets import load_sample_image

    photos = [Image.fromarray(load_sample_image(p)) for p in PHOTOS]
    rng = np.random.default_rng(SEED)
    for k in range(CLASSES):
        (root / f"class{k}").mkdir(parents=True)
    sizes = []
    for i in range(count):
        im = photos[i % len(photos)]
        bh = round(im.height * rng.uniform(0.88, 1.0))  # at least 375 rows: never enlarged, so photo detail
        bw = round(bh * 4 / 3)  # at most 569 of the photos' 640 pixels
        left, top = int(rng.integers(0, im.width - bw + 1)), int(rng.integers(0, im.height - bh + 1))
        out = im.resize((WIDTH, HEIGHT), Image.LANCZOS, box=(left, top, left + bw, top + bh))
        if rng.random() < 0.5:
            out = out.transpose(Image.FLIP_LEFT_RIGHT)
        path = root / f"class{i % CLASSES}" / f"{i:05d}.jpg"
        out.save(path, quality=QUALITY)  # Pillow's default 4:2:0 chroma subsampling, like most cameras' files
        sizes.append(path.stat().st_size)
    return {"count": count, "width": WIDTH, "height": HEIGHT, "quality": QUALITY, "classes": CLASSES,
            "mean_kb": round(sum(sizes) / len(sizes) / 1024, 1),
            "made_from": "random 4:3 crops (88-100% of the height) of scikit-learn's "
                         + " and ".join(PHOTOS) + ", Lanczos to 500x375, half mirrored"}


# The previous path, as it was before images stayed uint8 (167e18c: sources.decode and loader.Augmented).
OLD_MEAN = torch.tensor(IMAGENET[0]).view(3, 1, 1)
OLD_STD = torch.tensor(IMAGENET[1]).view(3, 1, 1)


def old_decode(path: str, size: int) -> torch.Tensor:
    """Shorter side resized to `size`, centre square cropped, normalised (CHW float32)."""
    from PIL import Image

    with Image.open(path) as im:
        im = im.convert("RGB")
        w, h = im.size
        s = size / min(w, h)
        im = im.resize((max(size, round(w * s)), max(size, round(h * s))), Image.BILINEAR)
        w, h = im.size
        left, top = (w - size) // 2, (h - size) // 2
        im = im.crop((left, top, left + size, top + size))
        x = torch.from_numpy(np.asarray(im, dtype=np.uint8).copy()).permute(2, 0, 1)
    return (x.float() / 255.0 - OLD_MEAN) / OLD_STD


def old_augment(x: torch.Tensor, i: int, epoch: int, seed: int) -> torch.Tensor:
    """Random crop (reflect-pad by 1/8, crop back) and horizontal flip on the float image."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + epoch) * 10_000_019 + i)
    r = torch.randint(0, 2**31 - 1, (3,), generator=g).tolist()
    size = x.shape[-1]
    pad = max(1, size // 8)
    x = F.pad(x.unsqueeze(0), (pad, pad, pad, pad), mode="reflect").squeeze(0)
    top, left = r[0] % (2 * pad + 1), r[1] % (2 * pad + 1)
    x = x[:, top:top + size, left:left + size]
    if r[2] % 2:
        x = x.flip(-1)
    return x.contiguous()


def before_epoch(paths, labels, size, batches, augment=True) -> int:
    """The previous loader's work for these batches: decode, augment (crop+flip), collate floats."""
    n = 0
    for keys in batches:
        xs = [old_decode(paths[i], size) for i, _ in keys]
        if augment:
            xs = [old_augment(x, i, e, SEED) for x, (i, e) in zip(xs, keys)]
        batch = torch.stack(xs), torch.tensor([labels[i] for i, _ in keys])  # the old collate
        n += len(batch[1])
    return n


def pillow_epoch(paths, batches) -> int:
    from PIL import Image

    n = 0
    for keys in batches:
        for i, _ in keys:
            with Image.open(paths[i]) as im:
                im.load()
            n += 1
    return n


def loader_epoch(samples: Samples, batches) -> int:
    """What one loader process does for these batches: Samples per key, then collate."""
    n = 0
    for keys in batches:
        b = collate([samples[k] for k in keys])
        if b.bad:
            raise RuntimeError(f"unreadable image in the benchmark's own data: {b.bad[0]}")
        n += len(b.y)
    return n


def epochs(n: int, batch: int, order=None):
    """epoch -> that epoch's batches of (index, epoch) keys, as the training loader's sampler gives them."""
    per = n // batch

    def of(epoch: int) -> list:
        return list(ShardedBatches(n, batch, seed=SEED, start=epoch * per, stop=(epoch + 1) * per, order=order))
    return of


def timed(fn) -> tuple[float, int]:
    t0 = time.perf_counter()
    n = fn()
    return time.perf_counter() - t0, n


def summary(values: list[float], digits: int) -> dict:
    return {"median": round(statistics.median(values), digits), "repeats": [round(v, digits) for v in values]}


def measure(rows: dict, repeats: int, warmup: int) -> dict:
    """rows: name -> (fn(batches) -> images, epoch -> batches). Images/s per row; the repeats go
    round-robin over the rows, repeat r on epoch r + 1, after `warmup` batches of epoch 0."""
    for fn, batches_of in rows.values():
        fn(batches_of(0)[:warmup])
    rates = {name: [] for name in rows}
    for r in range(repeats):
        for name, (fn, batches_of) in rows.items():
            batches = batches_of(r + 1)
            dt, n = timed(lambda: fn(batches))
            rates[name].append(n / dt)
    return {name: summary(v, 1) for name, v in rates.items()}


def device_part(files: FileDataset, size: int, batch: int, device: torch.device, repeats: int) -> dict:
    """Seconds per image of loader.Prepare on one epoch's batches, without and with the device's augmentations."""
    sets = {"none": []} | {n: [n] for n in ON_DEVICE} | {"+".join(ON_DEVICE): list(ON_DEVICE)}
    keys = epochs(len(files), batch)(1)
    work = {}
    for name, names in sets.items():
        samples = Samples(files, size, Augment(names, SEED) if names else None)
        work[name] = (Prepare(names, IMAGENET, device), [collate([samples[k] for k in ks]) for ks in keys])
    for prep, batches in work.values():  # warm-up: first calls allocate and pick kernels
        prep(batches[0])
    sync(device)
    secs = {name: [] for name in sets}
    for _ in range(repeats):
        for name, (prep, batches) in work.items():
            t0 = time.perf_counter()
            for b in batches:
                prep(b)
            sync(device)  # host-device sync: the clock must include the queued work
            secs[name].append((time.perf_counter() - t0) / sum(len(b.y) for b in batches))
    return {name: {"median": float(f"{statistics.median(v):.3g}"), "repeats": [float(f"{s:.3g}") for s in v]}
            for name, v in secs.items()}


def same_picture(paths, labels, size: int) -> dict:
    """Mean |new - previous| of the normalised centre crops (no augmentation), over every image."""
    samples = Samples(FileDataset(paths, labels), size)
    prep = Prepare([], IMAGENET, torch.device("cpu"))
    diffs = []
    for lo in range(0, len(paths), 32):
        new, _ = prep(collate([samples[(i, 0)] for i in range(lo, min(lo + 32, len(paths)))]))
        old = torch.stack([old_decode(paths[i], size) for i in range(lo, min(lo + 32, len(paths)))])
        diffs.append((new - old).abs().flatten(1).mean(1))
    d = torch.cat(diffs)
    return {"mean_abs_diff": round(d.mean().item(), 4), "worst_image": round(d.max().item(), 4),
            "unit": "normalised values (one channel standard deviation = 1)", "close": bool(d.mean() < 0.05)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=256, help="images written (a multiple of --batch is used)")
    ap.add_argument("--size", type=int, default=224, help="network input side, pixels")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2, help="batches run before the clock starts, per row")
    ap.add_argument("--model-rate", type=float, default=2500.0,
                    help="a replica's model images/s (2500: ResNet-50 training on a current GPU)")
    ap.add_argument("--shard-mb", type=float, default=4.0, help="shard size, MB")
    ap.add_argument("--device", default="cpu", help="where loader.Prepare runs (cpu, cuda)")
    ap.add_argument("--quick", action="store_true", help="32 images, one repeat, one warm-up batch")
    ap.add_argument("--save", action="store_true", help="also write benchmarks/results/input-TIME-COMMIT.json")
    a = ap.parse_args()
    if a.quick:
        a.count, a.repeats, a.warmup = a.batch, 1, 1
    load_before = os.getloadavg()
    torch.set_num_threads(1)  # one loader core: loader processes run one thread each (loader._one_thread)
    device = torch.device(a.device)
    rc_flip = "resized-crop+flip"
    aug_sets = {"none": []} | {n: [n] for n in AUGMENTATIONS} | {rc_flip: ["resized-crop", "flip"],
                                                                  "all": list(AUGMENTATIONS)}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "images"
        images = write_images(root, a.count)
        paths, labels, _ = scan_folder(str(root), CLASSES)
        n = len(paths) // a.batch * a.batch
        if n == 0:
            raise SystemExit(f"--count {a.count} is fewer than one batch of {a.batch}")
        paths, labels = paths[:n], labels[:n]
        files = FileDataset(paths, labels)

        cfg = build_config({"model": {"num_classes": CLASSES},
                            "data": {"name": "imagefolder", "root": str(root), "test_fraction": 0.0,
                                     "image_size": a.size, "batch_size": a.batch}})
        pack(cfg, Path(tmp) / "shards", int(a.shard_mb * 1e6), progress=False)
        train, _, _ = open_shards(str(Path(tmp) / "shards"), CLASSES, cfg.data.shuffle_buffer)

        by_file, by_shard = epochs(n, a.batch), epochs(len(train), a.batch, train.epoch_order)
        rows = {"before": (lambda b: before_epoch(paths, labels, a.size, b), by_file),
                "before_no_augment": (lambda b: before_epoch(paths, labels, a.size, b, augment=False), by_file),
                "pillow_decode_only": (lambda b: pillow_epoch(paths, b), by_file)}
        for src, data, order, names in [("files", files, by_file, aug_sets),
                                        ("shards", train, by_shard, ("none", rc_flip, "all"))]:
            for name in names:
                s = Samples(data, a.size, Augment(aug_sets[name], SEED) if aug_sets[name] else None)
                rows[f"{src}/{name}"] = (lambda b, s=s: loader_epoch(s, b), order)
        per_core = measure(rows, a.repeats, a.warmup)

        rate = {"files": per_core[f"files/{rc_flip}"]["median"], "shards": per_core[f"shards/{rc_flip}"]["median"]}
        result = {
            "benchmark": "input", "images": images, "image_size": a.size, "batch": a.batch, "repeats": a.repeats,
            "warmup_batches": a.warmup, "torch_threads": torch.get_num_threads(), "loader_processes": 0,
            "shards": len(train.files),
            "images_per_sec_per_core": per_core,
            # the usual training augmentation of each: crop+flip before, resized-crop+flip now
            "speedup_vs_before": {k: round(v / per_core["before"]["median"], 2) for k, v in rate.items()},
            "device_s_per_image": device_part(files, a.size, a.batch, device, a.repeats),
            "cores_per_replica": {f"{r:g} img/s": {k: round(r / v, 2) for k, v in rate.items()}
                                  for r in (a.model_rate, K80_RATE)},
            "same_picture": same_picture(paths, labels, a.size),
            **run_info(device),
        }
    print(json.dumps(result, indent=1))
    if a.save:
        save(result, load_before)


def save(result: dict, load_before: tuple) -> None:
    """The result with the command that made it, the machine's core count and load, and whether
    the tree differed from its commit (a figure of a dirty tree is not the commit's)."""
    commit, stamp = git_commit(), time.strftime("%Y-%m-%dT%H%MZ", time.gmtime())
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip() != ""
    out = ROOT / "benchmarks" / "results" / f"input-{stamp}-{commit[:7]}.json"
    out.write_text(json.dumps({"command": "python " + " ".join(sys.argv), **result, "git_dirty": dirty,
                               "cpus": os.cpu_count(), "load_before": load_before,
                               "load_after": os.getloadavg()}, indent=1) + "\n")
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
