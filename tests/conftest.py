"""Shared fixtures, and the suite's kinds: each folder of tests/ is a pytest marker.

unit    pure logic and single commands: seconds each, no job of several processes (make test-quick)
dist    real multi-process jobs over gloo: strategies, launchers, the job's figures
faults  injected failures: kill -9, SIGSTOP, SIGTERM, full disks, corrupt files, reruns
e2e     whole commands: bench, study, report, calibrate, a real (emulated) Slurm cluster
gpu     needs a CUDA GPU (make gpu-check); skipped elsewhere
"""

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"
KINDS = ("unit", "dist", "faults", "e2e", "gpu")


def pytest_collection_modifyitems(config, items):
    for item in items:
        kind = item.path.relative_to(ROOT / "tests").parts[0]
        if kind in KINDS:
            item.add_marker(kind)


@pytest.fixture
def digits_cfg():
    """The digits recipe, shortened: small enough for a unit test."""
    from scaletrain.config import load_config

    def make(*overrides):
        return load_config(RECIPES / "digits.toml", ["data.workers=0", "train.log_every=5", *overrides])

    return make


def scaletrain_cmd(*args):
    return [sys.executable, "-m", "scaletrain.cli", *args]


@pytest.fixture
def env():
    e = dict(os.environ)
    e["OMP_NUM_THREADS"] = "1"
    return e
