"""Datasets, packing into shards, decoding, augmentation, sharding and loading."""

from ..errors import DataError
from .build import build_datasets, check_data
from .loader import Batch, Prepare, ShardedBatches, test_loader, train_loader
from .sources import BadImage

__all__ = ["Batch", "BadImage", "DataError", "Prepare", "ShardedBatches", "build_datasets", "check_data",
           "test_loader", "train_loader"]
