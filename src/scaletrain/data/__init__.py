"""Datasets, packing into shards, decoding, augmentation, sharding and loading."""

from .loader import Batch, Prepare, ShardedBatches, test_loader, train_loader
from .sources import BadImage, DataError, build_datasets, check_files

__all__ = ["Batch", "BadImage", "DataError", "Prepare", "ShardedBatches", "build_datasets", "check_files",
           "test_loader", "train_loader"]
