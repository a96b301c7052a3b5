"""Resuming a run: its checkpoint's config checked against the run's, then the checkpoint loaded
into the model, the optimizer and the random states, and the job's progress taken up in images.

A resumed job goes on exactly as an uninterrupted one would: the same values, optimizer state,
random states and images applied (the job's progress, schedule.py). A key that changes what is
computed refuses the resume, naming it; one of RESUMABLE_CHANGES (how long to run, how often to
report) may differ.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .checkpoint import images_of, load_agreed
from .config import Config
from .errors import CheckpointError
from .strategies.traits import REGISTRY

log = logging.getLogger("scaletrain")

# Keys that may change between a run and its resumption: how long to run and
# how often to report, not what is being computed. data.decode moves the same decode between the
# loader and the device (nvJPEG's pixels may differ from libjpeg-turbo's by a rounding).
RESUMABLE_CHANGES = {
    "train.steps", "train.epochs", "train.eval_every", "train.checkpoint_every", "train.checkpoint_every_s",
    "cluster.max_restarts", "cluster.stop_signals", "cluster.min_nodes",
    "train.keep_checkpoints", "train.log_every", "train.warmup_log_steps", "train.target_accuracy",
    "train.target_loss",
    "data.workers", "data.prefetch", "data.decode", "cluster.master_addr", "cluster.master_port", "cluster.timeout_s",
    "cluster.network", "cluster.link_gbps", "cluster.slow_link_node", "cluster.slow_link_gbps", "cluster.time_scale",
    "cluster.ifname",
}


def check_config(path: Path, saved: dict[str, Any], current: dict[str, Any]) -> None:
    """CheckpointError naming the keys when `saved` (a checkpoint's config) differs from `current`
    in a key that matters for resuming."""
    diff = config_differences(saved, current)
    if diff:
        hint = f"; a resume at another node count is not defined for strategy.name = {current.get('strategy.name')!r}" \
            if "cluster.nodes" in diff else ""
        raise CheckpointError(f"{path} was written with another config; differing keys: " + ", ".join(
            f"{k} ({saved.get(k)!r} -> {current.get(k)!r})" for k in diff)
            + f"{hint}; to start a new run, choose another --run-dir")


def config_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Keys (flat, dotted) whose values differ and that matter for resuming. A key the
    saved config lacks (written before the key existed) counts as its default. Where every
    replica holds the one state (strategies/traits.py: resizable) the node count may change: progress
    is counted in images."""
    saved = {**Config().flat(), **saved}
    keys = (set(saved) | set(current)) - RESUMABLE_CHANGES
    name = current.get("strategy.name")
    if saved.get("strategy.name") == name and name in REGISTRY and REGISTRY[name].resizable:
        keys.discard("cluster.nodes")
    return sorted(k for k in keys if saved.get(k) != current.get(k))


def rng_state() -> dict[str, Any]:
    """The random states a resumed job continues from: the host's, and where this process computes
    on a GPU (CUDA is initialised), that device's alone. Every visible GPU's, as saved before, could
    not be restored where fewer are visible, and querying them set up a CUDA context on each."""
    st = {"torch": torch.get_rng_state()}
    if torch.cuda.is_initialized():
        st["cuda"] = torch.cuda.get_rng_state(torch.cuda.current_device())
    return st


def set_rng_state(st: dict[str, Any]) -> None:
    """Restore the chief's random states in this process: the host's, and on this process's GPU the
    chief's GPU state (cuda_rng_for)."""
    torch.set_rng_state(st["torch"])
    if "cuda" not in st or not torch.cuda.is_initialized():
        return  # this process computes on no GPU: no CUDA random state to restore
    index = torch.cuda.current_device()
    state = cuda_rng_for(st["cuda"], index)
    if state is None:
        log.warning("the checkpoint holds the CUDA random states of %d GPUs, none for cuda:%d: its random state "
                    "is not restored, so random operations on it do not repeat those of an uninterrupted run",
                    len(st["cuda"]), index)
        return
    torch.cuda.set_rng_state(state, index)


def cuda_rng_for(saved: torch.Tensor | list[torch.Tensor], index: int) -> torch.Tensor | None:
    """The CUDA random state that this process's device (`index`) continues from: the one saved
    (the chief's device's); from a checkpoint that saved every GPU the chief saw (a list), the
    entry of this index, as restoring them all gave this device; None where the list has none."""
    if isinstance(saved, torch.Tensor):
        return saved
    return saved[index] if index < len(saved) else None


@dataclass
class Resumed:
    """What a run continues from: the checkpoint's state, its file, and the job's progress."""

    state: dict[str, Any]
    path: Path
    images: int             # images the job had applied
    best: float | None      # best test accuracy so far
    bad: set[str]           # unreadable files met so far


def newest_checkpoint(ckpt_dir: Path, cfg, distributed: bool) -> tuple[dict[str, Any], Path] | None:
    """The newest checkpoint (the same in every process), checked to be of the same config; None when
    there is none."""
    found = load_agreed(ckpt_dir, distributed)
    if found is None:
        log.warning("--resume: no checkpoint in %s; starting from step 0", ckpt_dir)
        return None
    check_config(found[1], found[0]["config"], cfg.flat())
    return found


def resume_from(found: tuple[dict[str, Any], Path], model: torch.nn.Module, optimizer, step_images: int,
                own=None) -> Resumed:
    """Load a checkpoint (newest_checkpoint's) into model, optimizer and RNG. own: the part of the whole
    model's optimizer state this process's optimizer holds (a pipeline stage's), None: all of it."""
    state, path = found
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(own(state["optimizer"]) if own else state["optimizer"])
    set_rng_state(state["rng"])
    state["images"] = images_of(state)
    # The step of this job: the checkpoint's own counts job steps of its node count, which may differ.
    step = state["images"] // step_images
    log.info("resumed from %s at step %d%s", path, step,
             f" (the checkpoint's step {state['step']}, of another node count)" if step != state["step"] else "")
    return Resumed(state, path, state["images"], state["best_test_accuracy"], set(state["bad"]))
