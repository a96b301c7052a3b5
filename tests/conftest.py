"""Shared fixtures, and the suite's kinds: each folder of tests/ is a pytest marker.

unit    pure logic and single commands: seconds each, no job of several processes (make test-quick)
dist    real multi-process jobs over gloo: strategies, launchers, the job's figures
faults  injected failures: kill -9, SIGSTOP, SIGTERM, full disks, corrupt files, reruns
e2e     whole commands: bench, study, report, calibrate, a real (emulated) Slurm cluster
gpu     needs a CUDA GPU (make gpu-check); skipped elsewhere
"""

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

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


def write_images(root, classes=("happy_baby", "crying_baby", "sad_dog"), per_class=4, size=(20, 14)):
    rng = np.random.RandomState(0)
    rows = []
    for c in classes:
        (root / c).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            arr = rng.randint(0, 255, (size[1], size[0], 3), dtype=np.uint8)
            name = f"{c}/{i}.png" if i % 2 else f"{c}/{i}.jpg"
            Image.fromarray(arr).save(root / name)
            rows.append((name, c))
    return rows


def run_gloo_pair(tmp_path, name: str, text: str, timeout: float = 300) -> None:
    """Run the script `text` as ranks 0 and 1 of a two-process gloo group (its argv: rank, a free port,
    tmp_path, where it writes what the test reads); each must exit 0, else its stderr is the failure."""
    from scaletrain.launch.local import free_port

    script = tmp_path / name
    script.write_text(text)
    port = str(free_port("127.0.0.1"))
    procs = [subprocess.Popen([sys.executable, str(script), str(r), port, str(tmp_path)], stderr=subprocess.PIPE,
                              text=True) for r in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=timeout)
        assert p.returncode == 0, err


def free_port():
    """A TCP port free on loopback now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
