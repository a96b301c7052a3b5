"""A config's datasets: the one place that picks a source by data.name.

build_datasets makes the (train, test, class names) a job's processes train and evaluate on;
check_data raises, before any process starts, the DataError (or, for a user's dataset named by
import path or a GPU decode without torchvision, the ConfigError) they would meet doing so.
"""

from __future__ import annotations

from pathlib import Path

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
    d, n = cfg.data, cfg.model.num_classes
    if is_import_path(d.name):
        return user_datasets(cfg)
    if d.name == "digits":
        _digits_fit(n)
        return digits(d.image_size)
    if d.name == "synthetic":
        return synthetic(d.image_size, n, d.synthetic_size)
    if d.name == "shards":
        return open_shards(d.root, n, d.shuffle_buffer)
    train, test, classes = file_lists(cfg, run_dir, check)
    return FileDataset(*train), FileDataset(*test), classes


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
    elif d.name == "digits":
        _digits_fit(cfg.model.num_classes)
    elif d.name == "shards":
        open_shards(d.root, cfg.model.num_classes, d.shuffle_buffer)
    elif d.name != "synthetic":
        file_lists(cfg, run_dir)


def _digits_fit(num_classes: int) -> None:
    if num_classes < 10:
        raise DataError(f"data.name = 'digits' has 10 classes; model.num_classes = {num_classes} is too small")
