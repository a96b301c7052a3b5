"""Datasets, sharding and loading."""

from .loader import Batch, ShardedBatches, test_loader, train_loader
from .sources import BadImage, DataError, build_datasets

__all__ = ["Batch", "BadImage", "DataError", "ShardedBatches", "build_datasets", "test_loader", "train_loader"]
