"""A config's datasets: the one place that picks a source by data.name.

build_datasets makes the (train, test, class names) a job's processes train and evaluate on;
check_data raises, before any process starts, the DataError (or, for a user's dataset named by
import path or a GPU decode without torchvision, the ConfigError) they would meet doing so.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ..errors import DataError
from ..imports import is_import_path
from .device_input import torchvision_io
from .shards import open_shards
from .sources import FileDataset, digits, file_lists, synthetic
from .user import user_datasets


def build_datasets(cfg, run_dir: Path | None = None, check: bool = True
                   ) -> tuple[torch.utils.data.Dataset, torch.utils.data.Dataset, list[str]]:
    """(train, test, class names) for a Config; run_dir and check as for file_lists."""
    if is_import_path(cfg.data.name):
        return user_datasets(cfg)
    return SOURCES[cfg.data.name].make(cfg, run_dir, check)


def check_data(cfg, run_dir: Path | None = None) -> None:
    """The DataError the job's processes would meet building cfg's datasets, raised here first: a
    launcher checks before it makes the run directory or starts a process. Files are listed and
    checked, not read; the built-in sets are not made. A user's dataset is made, and its first
    sample of each split read (user.py). With run_dir, a manifest's check is recorded there
    (file_lists), so that the job's chief does not make it again."""
    d = cfg.data
    if d.decode == "device" and cfg.train.device != "cpu" and torch.cuda.device_count():
        torchvision_io()  # the job's processes will decode on their GPUs: torchvision must import there
    if is_import_path(d.name):
        user_datasets(cfg)
    else:
        SOURCES[d.name].check(cfg, run_dir)


def _digits_fit(num_classes: int) -> None:
    if num_classes < 10:
        raise DataError(f"data.name = 'digits' has 10 classes; model.num_classes = {num_classes} is too small")


def _digits(cfg, run_dir: Path | None = None, check: bool = True):
    _digits_fit(cfg.model.num_classes)
    return digits(cfg.data.image_size)


def _shards(cfg, run_dir: Path | None = None, check: bool = True):
    return open_shards(cfg.data.root, cfg.model.num_classes, cfg.data.shuffle_buffer)


def _files(cfg, run_dir: Path | None = None, check: bool = True):
    train, test, classes = file_lists(cfg, run_dir, check)
    return FileDataset(*train), FileDataset(*test), classes


@dataclass(frozen=True)
class Source:
    make: Callable     # (cfg, run_dir, check) -> (train, test, class names)
    check: Callable    # (cfg, run_dir) -> None, raising what make would, without reading images


# data.name -> its source: with recipe_values.SOURCES (what its data.root must name), a source's whole
# registration. check: shards open their index (cheap), files are listed and checked, built-ins not made.
SOURCES = {
    "digits": Source(_digits, lambda cfg, run_dir: _digits_fit(cfg.model.num_classes)),
    "synthetic": Source(lambda cfg, run_dir=None, check=True: synthetic(cfg.data.image_size, cfg.model.num_classes,
                                                                         cfg.data.synthetic_size),
                        lambda cfg, run_dir: None),
    "imagefolder": Source(_files, file_lists),
    "manifest": Source(_files, file_lists),
    "shards": Source(_shards, _shards),
}
