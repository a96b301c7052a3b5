"""Datasets: digits, synthetic, imagefolder, manifest.

Every dataset maps an index to (image CHW float32 of side image_size, label),
or to a BadImage record when a file cannot be decoded, so the loader can
apply the on_bad_image policy in one place. Problems that can be seen
without decoding (a missing file, a label out of range) are raised as
DataError at start-up, naming the file and line.
"""

from __future__ import annotations

import csv
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import DataError

IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".bmp", ".webp")
# ImageNet channel statistics: what pretrained ResNets expect.
MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)


@dataclass(frozen=True)
class BadImage:
    path: str
    reason: str


class TensorDataset(torch.utils.data.Dataset):
    """Images already decoded into one tensor (digits, synthetic)."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, length: int | None = None) -> None:
        self.images, self.labels = images, labels
        self.length = len(images) if length is None else length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int):
        j = i % len(self.images)
        return self.images[j], int(self.labels[i % len(self.labels)])


class FileDataset(torch.utils.data.Dataset):
    """Image files with integer labels, decoded on demand (in loader workers)."""

    def __init__(self, paths: list[str], labels: list[int], size: int) -> None:
        self.paths, self.labels, self.size = paths, labels, size

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int):
        path = self.paths[i]
        try:
            img = decode(path, self.size)
        except Exception as e:  # noqa: BLE001 - any decoder failure is a bad image
            return BadImage(path, f"{type(e).__name__}: {e}")
        return img, self.labels[i]


def decode(path: str, size: int) -> torch.Tensor:
    """Shorter side resized to `size`, centre square cropped, normalised."""
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
    return (x.float() / 255.0 - MEAN) / STD


def digits(size: int) -> tuple[TensorDataset, TensorDataset, list[str]]:
    """scikit-learn's 1,797 8x8 handwritten digits; fixed 80/20 split."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False).expand(-1, 3, -1, -1)
    y = torch.tensor(d.target, dtype=torch.long)
    order = torch.from_numpy(np.random.RandomState(0).permutation(len(y)))
    n_test = len(y) // 5
    test, train = order[:n_test], order[n_test:]
    mean, std = x[train].mean(), x[train].std()
    x = ((x - mean) / std).contiguous()
    return (TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test]),
            [str(i) for i in range(10)])


def synthetic(size: int, num_classes: int, length: int) -> tuple[TensorDataset, TensorDataset, list[str]]:
    """Random images for throughput work: a fixed pool of 64, cycled."""
    g = torch.Generator().manual_seed(1234)
    pool = torch.randn(64, 3, size, size, generator=g)
    labels = torch.randint(0, num_classes, (max(length, 256),), generator=g)
    return (TensorDataset(pool, labels, length), TensorDataset(pool, labels[:256], 256),
            [str(i) for i in range(num_classes)])


def _split(paths: list[str], labels: list[int], fraction: float) -> tuple[tuple, tuple]:
    order = np.random.RandomState(0).permutation(len(paths))  # same test set for every seed
    n_test = int(round(len(paths) * fraction))
    pick = lambda idx: ([paths[i] for i in idx], [labels[i] for i in idx])  # noqa: E731
    return pick(order[n_test:]), pick(order[:n_test])


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


def read_manifest(path: str, num_classes: int, classes: list[str] | None = None) -> tuple[list, list, list]:
    """CSV of `path,label` (optional header); label = class name or index.

    Relative image paths are taken from the manifest's directory. Named
    classes are numbered in sorted order; every row is checked here.
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
    base = mp.parent
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
        full = p if os.path.isabs(p) else str(base / p)
        if not os.path.exists(full):
            raise DataError(f"{path} line {lineno}: image {full} does not exist")
        paths.append(full)
        labels.append(y)
    return paths, labels, classes


def build_datasets(cfg) -> tuple[torch.utils.data.Dataset, torch.utils.data.Dataset, list[str]]:
    """(train, test, class names) for a Config."""
    d, n = cfg.data, cfg.model.num_classes
    if d.name == "digits":
        if n < 10:
            raise DataError(f"data.name = 'digits' has 10 classes; model.num_classes = {n} is too small")
        return digits(d.image_size)
    if d.name == "synthetic":
        return synthetic(d.image_size, n, d.synthetic_size)
    read = scan_folder if d.name == "imagefolder" else read_manifest
    paths, labels, classes = read(d.root, n)
    if d.test_root:
        test = read(d.test_root, n, classes)[:2]
        train = (paths, labels)
    else:
        train, test = _split(paths, labels, d.test_fraction)
    if not train[0]:
        raise DataError(f"data.root: {d.root} leaves no training images after holding out the test set")
    return FileDataset(*train, d.image_size), FileDataset(*test, d.image_size), classes
