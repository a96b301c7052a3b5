"""The GPU acceptance suite: every test here needs a CUDA GPU, is marked `gpu`, and is skipped
where torch sees none, so the default `pytest -q` run on a CPU machine shows them as skipped.
`make gpu-check` runs them (`pytest -m gpu tests/gpu`) before the GPU benchmarks.

The directory is a package so that this conftest is `gpu.conftest`, not a second module
named `conftest` in place of tests/conftest.py (which other tests import from)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from .runs import train

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    # This hook sees the whole session's items, not only this directory's.
    mine = [item for item in items if HERE in item.path.parents]
    if mine and not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in mine:
            item.add_marker(skip)


@pytest.fixture
def train_run(tmp_path):
    """run(name, *overrides, recipe=..., resume=False): `scaletrain train` into tmp_path/name."""
    return lambda name, *sets, **kw: train(tmp_path / name, *sets, **kw)


@pytest.fixture(scope="session")
def gpu_name() -> str:
    """What summary.json's `device` says of a run on GPU 0 (a CUDA context in this process)."""
    return torch.cuda.get_device_name(0)
