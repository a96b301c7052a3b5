"""Datasets: digits, synthetic, imagefolder, manifest (shards: shards.py; a user's: user.py; a
config's: build.py).

Every dataset maps an index to (image, label): the encoded bytes of a file,
or pixels already decoded (HWC uint8); `name(i)` says which file or sample
an index is, and `stats` are the channel means and deviations (of [0, 1]
values) the device normalises with. Decoding, cropping and augmentation are
the loader's (loader.Samples), which turns any failure into a BadImage so
the on_bad_image policy applies in one place. Problems that can be seen
without decoding (a missing file, a label out of range) are raised as
DataError at start-up, naming the file and line.

Whether every file a manifest lists exists is checked once a job, not once a
process: it is a stat a row (1.2 million for ImageNet), each a request to a
parallel file system's metadata servers, times the processes. The launcher checks
before it starts the processes (run.py), else the chief; the check is recorded
in the run directory against the manifests' sizes and times (a changed
manifest is checked again), and the other processes find a file gone since
when they read it (a BadImage).
"""

from __future__ import annotations

import csv
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import DataError

IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".bmp", ".webp")
# ImageNet channel statistics: what pretrained ResNets expect.
IMAGENET = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))


@dataclass(frozen=True)
class BadImage:
    path: str
    reason: str


class TensorDataset(torch.utils.data.Dataset):
    """Images already decoded into one N x H x W x 3 uint8 tensor (digits, synthetic)."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, stats: tuple, length: int | None = None,
                 what: str = "image") -> None:
        self.images, self.labels, self.stats, self.what = images, labels, stats, what
        self.length = len(images) if length is None else length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int):
        return self.images[i % len(self.images)], int(self.labels[i % len(self.labels)])

    def name(self, i: int) -> str:
        return f"{self.what} {i}"


class FileDataset(torch.utils.data.Dataset):
    """Image files with integer labels, read whole (decoded in the loader)."""

    stats = IMAGENET

    def __init__(self, paths: list[str], labels: list[int]) -> None:
        self.paths, self.labels = paths, labels

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int):
        with open(self.paths[i], "rb") as fh:
            return fh.read(), self.labels[i]

    def name(self, i: int) -> str:
        return self.paths[i]


def to_pixels(x: torch.Tensor) -> torch.Tensor:
    """N x C x H x W floats in [0, 1] -> N x H x W x 3 uint8 (grey repeated to RGB)."""
    x = (x.clamp(0, 1) * 255).round().to(torch.uint8).expand(-1, 3, -1, -1)
    return x.permute(0, 2, 3, 1).contiguous()


def digits(size: int) -> tuple[TensorDataset, TensorDataset, list[str]]:
    """scikit-learn's 1,797 8x8 handwritten digits; fixed 80/20 split."""
    from sklearn.datasets import load_digits  # heavy (scipy, a second of CPU): only the digits need it

    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    x = to_pixels(F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False))
    y = torch.tensor(d.target, dtype=torch.long)
    order = torch.from_numpy(np.random.RandomState(0).permutation(len(y)))
    n_test = len(y) // 5
    test, train = order[:n_test], order[n_test:]
    v = x[train].double() / 255
    stats = ((v.mean().item(),) * 3, (v.std().item(),) * 3)  # grey: one mean and deviation for all channels
    return (TensorDataset(x[train], y[train], stats, what="digit"), TensorDataset(x[test], y[test], stats, what="digit"),
            [str(i) for i in range(10)])


def synthetic(size: int, num_classes: int, length: int) -> tuple[TensorDataset, TensorDataset, list[str]]:
    """Random images for throughput work: a fixed pool of 64, cycled."""
    g = torch.Generator().manual_seed(1234)
    pool = torch.randint(0, 256, (64, size, size, 3), generator=g, dtype=torch.uint8)
    labels = torch.randint(0, num_classes, (max(length, 256),), generator=g)
    return (TensorDataset(pool, labels, IMAGENET, length), TensorDataset(pool, labels[:256], IMAGENET, 256),
            [str(i) for i in range(num_classes)])


def held_out(n: int, fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(train, test) positions of n samples, round(n x fraction) of them held out for testing: a
    fixed split, the same test set for every train.seed (so runs of several seeds compare)."""
    order = np.random.RandomState(0).permutation(n)
    n_test = int(round(n * fraction))
    return order[n_test:], order[:n_test]


def _split(paths: list[str], labels: list[int], fraction: float) -> tuple[tuple, tuple]:
    pick = lambda idx: ([paths[i] for i in idx], [labels[i] for i in idx])  # noqa: E731
    return tuple(pick(idx) for idx in held_out(len(paths), fraction))


def scan_folder(root: str, num_classes: int, classes: list[str] | None = None) -> tuple[list, list, list]:
    """root/CLASS/*.jpg|png -> paths, labels, classes (sorted class directories)."""
    r = Path(root)
    if not r.is_dir():
        raise DataError(f"data.root: directory {root} does not exist")
    found = sorted(d.name for d in r.iterdir() if d.is_dir())
    if classes is None:
        classes = found
    if not classes:
        raise DataError(f"data.root: {root} has no class directories (expected root/CLASS/*.jpg)")
    if len(classes) > num_classes:
        raise DataError(f"{r / classes[num_classes]}: class index {num_classes} is outside "
                        f"[0, {num_classes}) (model.num_classes = {num_classes}; {len(classes)} class directories)")
    index = {c: i for i, c in enumerate(classes)}
    paths, labels = [], []
    for c in found:
        if c not in index:
            raise DataError(f"{r / c}: class {c!r} is not among the training classes")
        for f in sorted((r / c).iterdir()):
            if f.suffix.lower() in IMAGE_EXTS:
                paths.append(str(f))
                labels.append(index[c])
    if not paths:
        raise DataError(f"data.root: no images ({', '.join(IMAGE_EXTS)}) under {root}")
    return paths, labels, classes


def read_manifest(path: str, num_classes: int, classes: list[str] | None = None,
                  check: bool = True) -> tuple[list, list, list]:
    """CSV of `path,label` (optional header); label = class name or index.

    Relative image paths are taken from the manifest's directory. Named
    classes are numbered in sorted order; every row is checked here, and
    with `check` that its file exists (a stat a row).
    """
    mp = Path(path)
    if not mp.is_file():
        raise DataError(f"data.root: manifest {path} does not exist")
    rows = []
    with open(mp, newline="") as fh:
        for lineno, row in enumerate(csv.reader(fh), start=1):
            if not row or row[0].startswith("#"):
                continue
            if lineno == 1 and [c.strip().lower() for c in row[:2]] == ["path", "label"]:
                continue
            if len(row) != 2:
                raise DataError(f"{path} line {lineno}: expected 'path,label', got {len(row)} fields")
            rows.append((lineno, row[0].strip(), row[1].strip()))
    if not rows:
        raise DataError(f"{path}: manifest has no rows")
    named = [r for r in rows if not r[2].lstrip("-").isdigit()]
    if named and len(named) != len(rows):
        bad = next(r for r in rows if r[2].lstrip("-").isdigit())
        raise DataError(f"{path} line {bad[0]}: label {bad[2]!r} is an index but other rows use class names")
    if classes is None:
        classes = sorted({r[2] for r in rows}) if named else [str(i) for i in range(num_classes)]
    index = {c: i for i, c in enumerate(classes)}
    base = os.path.dirname(path)
    paths, labels = [], []
    for lineno, p, lab in rows:
        if named:
            if lab not in index:
                raise DataError(f"{path} line {lineno}: class {lab!r} is not among the training classes")
            y = index[lab]
        else:
            y = int(lab)
        if not 0 <= y < num_classes:
            what = f"label {lab!r}" + (f" (class index {y})" if named else "")
            raise DataError(f"{path} line {lineno}: {what} is outside [0, {num_classes}) "
                            f"(model.num_classes = {num_classes})")
        full = os.path.join(base, p)  # p itself when absolute; much cheaper a row than Path's /
        if check and not os.path.exists(full):
            raise DataError(f"{path} line {lineno}: image {full} does not exist")
        paths.append(full)
        labels.append(y)
    return paths, labels, classes


def file_lists(cfg, run_dir: Path | None = None, check: bool = True
               ) -> tuple[tuple[list, list], tuple[list, list], list[str]]:
    """((train paths, labels), (test paths, labels), class names) of an imagefolder or manifest.

    check: that every file a manifest lists exists; with run_dir, only where the run directory
    holds no check of the manifests as they are now, and a check made is recorded there."""
    d, n = cfg.data, cfg.model.num_classes
    stamps = _stamps(d) if check and run_dir is not None and d.name == "manifest" else None
    if stamps is not None and _recorded(run_dir) == stamps:
        check = False
    read = scan_folder if d.name == "imagefolder" else lambda *a: read_manifest(*a, check=check)
    paths, labels, classes = read(d.root, n)
    if d.test_root:
        test = read(d.test_root, n, classes)[:2]
        train = (paths, labels)
    else:
        train, test = _split(paths, labels, d.test_fraction)
    if not train[0]:
        raise DataError(f"data.root: {d.root} leaves no training images after holding out the test set")
    if stamps is not None and check:
        _record(run_dir, stamps)
    return train, test, classes


CHECKED = "logs/manifest-checked.json"  # in the run directory: the manifests whose files were all found


def _stamps(d) -> list | None:
    """[absolute path, size, mtime in ns] of each manifest the data config reads; None when one
    cannot be read (read_manifest names it)."""
    try:
        return [[os.path.abspath(p), st.st_size, st.st_mtime_ns] for p in (d.root, d.test_root) if p
                for st in [os.stat(p)]]
    except OSError:
        return None


def _recorded(run_dir: Path) -> list | None:
    try:
        return json.loads((Path(run_dir) / CHECKED).read_text())["manifests"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _record(run_dir: Path, stamps: list) -> None:
    path = Path(run_dir) / CHECKED
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"manifests": stamps}) + "\n")
    os.replace(tmp, path)  # a reader never sees half a record
