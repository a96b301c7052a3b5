import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"


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
