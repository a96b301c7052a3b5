"""Runs of `scaletrain train` for the GPU tests, each a process of its own, as a user starts it:
torch's process-wide switches (deterministic kernels, compiled graphs, the CUDA context) stay
in the run that set them. The jobs are local: Slurm's and torchrun's variables are left out of
their environment, so the local launcher places every process on this machine's GPUs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
DIGITS = ROOT / "recipes" / "digits.toml"
# The digits recipe's network and schedule on synthetic images of its size: the data set is not what
# these tests check, and the digits would need scikit-learn and scipy (45 MB of wheels a Python) on a
# GPU machine that has no package index (benchmarks/gpu_bundle.py).
SYNTHETIC = ["data.name=synthetic", "data.synthetic_size=1440"]
RUN_TIMEOUT_S = 600


def local_env() -> dict[str, str]:
    """This environment without a launcher's or scheduler's rank variables: a local job."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))}


def train_cmd(run_dir: Path, *sets: str, recipe: Path | None = DIGITS, resume: bool = False) -> list[str]:
    cmd = [sys.executable, "-m", "scaletrain.cli", "train", "--run-dir", str(run_dir), "--quiet"]
    cmd += ["--recipe", str(recipe)] if recipe else []
    cmd += ["--resume"] if resume else []
    for s in [*SYNTHETIC, *sets] if recipe == DIGITS else sets:
        cmd += ["--set", s]
    return cmd


@dataclass
class Finished:
    run_dir: Path
    summary: dict
    weights: dict[str, torch.Tensor]


def train(run_dir: Path, *sets: str, recipe: Path | None = DIGITS, resume: bool = False) -> Finished:
    """`scaletrain train` into run_dir; fails the test with the run's last words unless it exits 0."""
    from safetensors.torch import load_file

    r = subprocess.run(train_cmd(run_dir, *sets, recipe=recipe, resume=resume), env=local_env(), cwd=ROOT,
                       capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    if r.returncode != 0:
        logs = sorted((run_dir / "logs").glob("*.log")) if (run_dir / "logs").is_dir() else []
        tails = "".join(f"\n--- {p.name}\n{p.read_text()[-2000:]}" for p in logs)
        pytest.fail(f"scaletrain train exited {r.returncode}:\n{r.stderr[-4000:]}{tails}", pytrace=False)
    return Finished(run_dir, json.loads((run_dir / "summary.json").read_text()),
                    load_file(str(run_dir / "model.safetensors")))


def differing(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """The tensors of two sets of weights that differ in any bit (empty: the same weights)."""
    assert a.keys() == b.keys()
    return [k for k in a if not torch.equal(a[k], b[k])]


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a if a[k].numel())
