"""A user's dataset: data.name = "package.module:factory", called with the keywords of [data.args].

The factory returns a map-style torch Dataset of (image, label), from which data.test_fraction
is held out as from a manifest (sources.held_out: a fixed split, the same for every seed), or a
tuple (train, test, classes). An image is a C x H x W torch tensor (float in [0, 1], or uint8;
C = 1 or 3) or an H x W x C uint8 NumPy array (C = 1 or 3); a label an integer in
[0, model.num_classes).

UserDataset presents it as the built-in sources are presented (sources.py): index -> (H x W x 3
uint8 pixels, label), with `name(i)` and `stats`. From there a sample takes the one path every
source takes: the loader's Samples cuts the centre square (or data.augment's box) and resizes it to
data.image_size (decode.fit: antialiased bilinear on uint8), the augmentations apply, and Prepare
normalises on the device with `stats`: the dataset's own attribute `stats` ((R, G, B means),
(R, G, B deviations) of [0, 1] values) when it has one, else ImageNet's, as for image files. The
sampler (per-replica slices, exact resume) and the job's figures are those of every source.

user_datasets imports the module, calls the factory and reads the first sample of each split,
raising a ConfigError of one line naming data.name; the launcher does so before it starts any
process (build.check_data), so the factory runs once more than the job has processes: a dataset
that is costly to make should leave the reading to its __getitem__. A later sample that is not of
these forms, or whose label is out of range, is a BadImage naming it when it is read
(data.on_bad_image), like an unreadable file.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ..errors import ConfigError
from ..imports import import_path, one_line
from .sources import IMAGENET, held_out

EXPECTED = ("a C x H x W torch tensor (float in [0, 1], or uint8; C = 1 or 3) or an H x W x C uint8 "
            "numpy array (C = 1 or 3)")
# Floats are rounded to the nearest of 256 levels: within half a level of [0, 1] is in range.
_SLACK = 0.5 / 255


def describe(x) -> str:
    """What a value is, for an error: its type, and a tensor's or array's dtype and shape."""
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor of shape {tuple(x.shape)}"
    if isinstance(x, np.ndarray):
        return f"a numpy {x.dtype} array of shape {x.shape}"
    if isinstance(x, (tuple, list)):
        return f"a {type(x).__name__} of {len(x)}"
    kind = type(x)
    name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    return f"an object of type {name}"


def pixels(image) -> torch.Tensor:
    """An image of the accepted forms -> H x W x 3 uint8 (grey repeated); ValueError saying what it
    is otherwise. One copy of the image in uint8 (the CHW to HWC reordering, or the array's copy:
    it may be read-only or shared with the dataset)."""
    if isinstance(image, torch.Tensor) and image.dim() == 3 and image.shape[0] in (1, 3) and (
            image.dtype == torch.uint8 or image.is_floating_point()):
        x = image.detach().cpu()
        if x.is_floating_point():
            lo, hi = x.min().item(), x.max().item()
            if lo < -_SLACK or hi > 1 + _SLACK:
                raise ValueError(f"image is {describe(image)} with values in [{lo:g}, {hi:g}]; expected floats "
                                 "in [0, 1], not normalised (divide by 255, or return uint8)")
            x = (x.float().clamp(0, 1) * 255).round().to(torch.uint8)
        x = x.permute(1, 2, 0)
    elif isinstance(image, np.ndarray) and image.ndim == 3 and image.shape[2] in (1, 3) and image.dtype == np.uint8:
        x = torch.tensor(image)
    else:
        raise ValueError(f"image is {describe(image)}; expected {EXPECTED}")
    if not x.shape[0] or not x.shape[1]:
        raise ValueError(f"image is {describe(image)}: it has no pixels")
    return x.expand(-1, -1, 3).contiguous()


def label(y, num_classes: int) -> int:
    """A label (int, NumPy integer, or one-element integer tensor) -> int in [0, num_classes);
    ValueError saying what it is otherwise."""
    if isinstance(y, torch.Tensor) and y.numel() == 1 and not y.is_floating_point() and not y.is_complex() \
            and y.dtype != torch.bool:
        y = int(y.item())
    elif isinstance(y, np.integer):
        y = int(y)
    if not isinstance(y, int) or isinstance(y, bool):
        raise ValueError(f"label is {describe(y)}; expected an int")
    if not 0 <= y < num_classes:
        raise ValueError(f"label {y} is outside [0, {num_classes}) (model.num_classes = {num_classes})")
    return y


def sample(s, num_classes: int) -> tuple[torch.Tensor, int]:
    """One (image, label) of the user's dataset -> (H x W x 3 uint8, int); ValueError otherwise."""
    if not isinstance(s, (tuple, list)) or len(s) != 2:
        raise ValueError(f"it is {describe(s)}; expected (image, label)")
    return pixels(s[0]), label(s[1], num_classes)


class UserDataset(torch.utils.data.Dataset):
    """The samples at `positions` of a user's dataset, as the built-in sources give theirs."""

    def __init__(self, base, positions, what: str, num_classes: int, stats: tuple) -> None:
        self.base, self.positions, self.what, self.num_classes, self.stats = base, positions, what, num_classes, stats

    def __len__(self) -> int:
        return len(self.positions)

    def __getitem__(self, i: int):
        return sample(self.base[int(self.positions[i])], self.num_classes)

    def name(self, i: int) -> str:
        return f"{self.what} sample {int(self.positions[i])}"


def user_datasets(cfg) -> tuple[UserDataset, UserDataset, list[str]]:
    """(train, test, class names) of cfg's data.name = package.module:factory; ConfigError of one
    line naming data.name when it cannot be imported, called, or read."""
    d, n = cfg.data, cfg.model.num_classes
    where = f"data.name = {d.name!r}"
    factory = import_path("data.name", d.name)
    if not callable(factory):
        raise ConfigError(f"{where}: {describe(factory)} is not callable; expected a function that returns the dataset")
    try:
        made = factory(**d.args)
    except Exception as e:  # noqa: BLE001 - whatever the user's code raises, named in one line
        given = f" (data.args = {d.args!r})" if d.args else ""
        raise ConfigError(f"{where}: the factory raised {one_line(e)}{given}") from None
    if isinstance(made, tuple) and len(made) == 3:
        train, test, classes = made
        sizes = [_size(where, "the train set of its (train, test, classes)", train),
                 _size(where, "the test set of its (train, test, classes)", test)]
        parts = [(train, range(sizes[0]), f"{d.name} train"), (test, range(sizes[1]), f"{d.name} test")]
    elif isinstance(made, torch.utils.data.Dataset):
        classes = getattr(made, "classes", None)
        parts = [(made, positions, d.name) for positions in held_out(_size(where, "the dataset", made), d.test_fraction)]
        train = made
    else:
        raise ConfigError(f"{where}: the factory returned {describe(made)}; expected a torch.utils.data.Dataset of "
                          "(image, label) or a tuple (train, test, classes)")
    stats = _stats(where, getattr(train, "stats", IMAGENET))
    out = [UserDataset(base, positions, what, n, stats) for base, positions, what in parts]
    if not len(out[0]):
        raise ConfigError(f"{where}: no training samples" + ("" if isinstance(made, tuple) else
                          f" are left after holding out data.test_fraction = {d.test_fraction}"))
    for ds, split in zip(out, ("training", "test")):
        if len(ds):
            _first(where, split, ds)
    return out[0], out[1], _classes(where, classes, n)


def _size(where: str, what: str, ds) -> int:
    if not isinstance(ds, torch.utils.data.Dataset) or isinstance(ds, torch.utils.data.IterableDataset):
        raise ConfigError(f"{where}: {what} is {describe(ds)}; expected a map-style torch.utils.data.Dataset "
                          "(len() and [i]: replicas take their samples by index)")
    try:
        return len(ds)
    except Exception as e:  # noqa: BLE001 - a Dataset without __len__ raises TypeError; the user's code anything
        raise ConfigError(f"{where}: len() of {what} raised {one_line(e)}; replicas take their samples by index "
                          "from a map-style dataset with a length") from None


def _first(where: str, split: str, ds: UserDataset) -> None:
    """Reads the first sample of a split and checks its form: what the loader would meet first."""
    p = int(ds.positions[0])
    try:
        s = ds.base[p]
    except Exception as e:  # noqa: BLE001 - whatever the user's code raises, named in one line
        raise ConfigError(f"{where}: reading {split} sample {p} raised {one_line(e)}") from None
    try:
        sample(s, ds.num_classes)
    except ValueError as e:
        raise ConfigError(f"{where}: {split} sample {p}: {e}") from None


def _classes(where: str, classes, n: int) -> list[str]:
    if classes is None:
        return [str(i) for i in range(n)]
    if isinstance(classes, str) or not isinstance(classes, Sequence) or not classes:
        raise ConfigError(f"{where}: the classes are {describe(classes)}; expected a non-empty list of class names")
    if len(classes) > n:
        raise ConfigError(f"{where}: {len(classes)} classes; model.num_classes = {n} is too small")
    return [str(c) for c in classes]


def _stats(where: str, stats) -> tuple:
    try:
        t = torch.tensor(stats, dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError):
        t = None
    if t is None or t.shape != (2, 3) or not bool((t[1] > 0).all()):
        raise ConfigError(f"{where}: the dataset's stats are {stats!r}; expected ((R, G, B means), (R, G, B "
                          "deviations)) of [0, 1] values, deviations above 0")
    return tuple(tuple(row) for row in t.tolist())
