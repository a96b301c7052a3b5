"""The run directory before a run: checks made before any process starts, and whether the run
continues from a checkpoint, or is over and must not be touched (a run is never overwritten)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from . import checkpoint, schedule
from .config import Config
from .errors import ConfigError, Finished
from .proc.env import LATE
from .resume import check_config

log = logging.getLogger("scaletrain")


def prepare_run_dir(run_dir: Path, resume: bool, cfg: Config) -> bool:
    """Checks made before any process starts (and before a launcher writes config.toml, so a
    refused run leaves the directory as it was). Returns whether the run continues from a
    checkpoint: with --resume, or on its own when the directory holds a checkpoint written with
    this config (one with another config is refused, naming the keys). Raises Finished when that
    run is over for this config (finished_at): a run is never overwritten. A directory that is not
    there yet is not made here but by the first to write to it (`make`, a launcher), once the
    config and the data have been checked: a run refused before that leaves nothing behind. A
    replacement (launch/keep.py) joins the running job, which owns the directory: nothing is checked
    or cleared, and its state comes from a live replica."""
    if os.environ.get(LATE):
        return False
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"--run-dir {run_dir} is a file, not a directory")
    if not run_dir.exists():
        parent = run_dir.absolute().parent
        while not parent.exists():
            parent = parent.parent
        if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
            why = "a file" if not parent.is_dir() else "not writable"
            raise ConfigError(f"--run-dir {run_dir}: cannot create it ({parent} is {why})")
        return resume
    if not os.access(run_dir, os.W_OK | os.X_OK):
        raise ConfigError(f"--run-dir {run_dir} is not writable")
    for stale in run_dir.glob("*.tmp"):  # model.safetensors or summary.json of a killed run, half written
        stale.unlink()
    found = checkpoint.newest(run_dir / "checkpoints")  # quiet: the resume itself warns of a fallback
    if found is None:
        return resume
    state, path, _ = found
    check_config(path, state["config"], cfg.flat())
    over = finished_at(run_dir, cfg, state)
    if over is not None:  # running it again would only overwrite its results with those of zero steps
        raise Finished(f"{run_dir} holds a finished run (step {state['step']}, the target of {over} steps): "
                       f"its results are in {run_dir / 'summary.json'}; nothing was run "
                       "(raise train.steps or train.epochs to continue it)")
    if not resume:
        log.info("%s holds a run of this config: resuming from %s (step %d)", run_dir, path.name,
                 checkpoint.images_of(state) // schedule.step_images(cfg))
    return True


def make(run_dir: Path) -> None:
    """Make the run directory (and its parents) when it is not there yet."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--run-dir {run_dir}: cannot create it ({e.strerror})") from None


def finished_at(run_dir: Path, cfg: Config, state: dict[str, Any]) -> int | None:
    """The job steps of cfg's target when the run in run_dir is over for cfg: its newest checkpoint
    (state) reached the target and the chief wrote summary.json; None while there is work left. A
    target in epochs is counted over the training set the summary records (the data keys cannot
    differ from the checkpoint's: check_config)."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    train_images = summary.get("train_images") if isinstance(summary, dict) else None
    if not cfg.train.steps and not train_images:
        return None  # epochs over a training set of unknown size: building it is the job's work
    sched = schedule.from_config(cfg, train_images or 0)
    images = state.get("images", state["step"] * sched.step_images)  # checkpoints written before images were kept
    return sched.steps if images >= sched.target else None
