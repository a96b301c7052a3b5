"""Atomic checkpoints, exact resume, safe load.

A checkpoint is written to `ckpt-STEP.pt.tmp`, flushed to disk, then renamed
to `ckpt-STEP.pt`; rename is atomic on POSIX file systems, so a crash leaves
either the old set of complete checkpoints or the new one, never a partial
file under a loadable name. Loading uses weights_only=True.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .errors import CheckpointError

log = logging.getLogger("scaletrain")
PATTERN = re.compile(r"^ckpt-(\d{8,})\.pt$")
# Keys that may change between a run and its resumption: how long to run and
# how often to report, not what is being computed.
RESUMABLE_CHANGES = {
    "train.steps", "train.epochs", "train.eval_every", "train.checkpoint_every", "train.checkpoint_every_s",
    "cluster.max_restarts", "cluster.stop_signals",
    "train.keep_checkpoints", "train.log_every", "train.warmup_log_steps", "train.target_accuracy",
    "train.target_loss",
    "data.workers", "data.prefetch", "cluster.master_addr", "cluster.master_port", "cluster.timeout_s",
}


def path_for(ckpt_dir: Path, step: int) -> Path:
    return ckpt_dir / f"ckpt-{step:08d}.pt"


def list_complete(ckpt_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints, oldest first (temporary files are ignored)."""
    if not ckpt_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in ckpt_dir.iterdir() if (m := PATTERN.match(p.name))]
    return sorted(found)


def save(ckpt_dir: Path, step: int, state: dict[str, Any], keep: int) -> Path:
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    final = path_for(ckpt_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    with open(tmp, "wb") as fh:
        torch.save(state, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, final)
    _fsync_dir(ckpt_dir)
    for _, old in list_complete(ckpt_dir)[:-keep]:
        old.unlink(missing_ok=True)
    return final


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_latest(ckpt_dir: Path) -> tuple[dict[str, Any], Path] | None:
    """The newest checkpoint that loads; None when there is none."""
    errors = []
    for _, p in reversed(list_complete(ckpt_dir)):
        try:
            return torch.load(p, map_location="cpu", weights_only=True), p
        except Exception as e:  # noqa: BLE001 - fall back to the previous one
            errors.append(f"{p.name}: {e}")
    if errors:
        raise CheckpointError(f"no checkpoint in {ckpt_dir} could be read: " + "; ".join(errors))
    return None


def load_agreed(ckpt_dir: Path, distributed: bool) -> tuple[dict[str, Any], Path] | None:
    """The newest checkpoint, the same file in every process of a job: rank 0 chooses
    it and broadcasts its step (a collective: every process, PS included, calls this
    once when resuming), so a file another node cannot see yet, or a fallback to an
    older one on a single node, cannot split the job."""
    if not distributed:
        return load_latest(ckpt_dir)
    import torch.distributed as dist

    choice, found, err = torch.tensor([-1]), None, None
    if dist.get_rank() == 0:
        try:
            found = load_latest(ckpt_dir)
            choice[0] = -1 if found is None else found[0]["step"]
        except CheckpointError as e:
            err, choice[0] = e, -2
    dist.broadcast(choice, src=0)
    step = int(choice[0])
    if err is not None:
        raise err
    if step == -2:
        raise CheckpointError(f"rank 0 could read no checkpoint in {ckpt_dir}; its log says why")
    if step == -1 or found is not None:
        return found
    path = path_for(ckpt_dir, step)
    try:
        return torch.load(path, map_location="cpu", weights_only=True), path
    except Exception as e:  # noqa: BLE001 - one line naming the file
        raise CheckpointError(f"{path}: chosen by rank 0 but not readable here: {str(e).splitlines()[0]}") from None


def config_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Keys (flat, dotted) whose values differ and that matter for resuming. A key the
    saved config lacks (written before the key existed) counts as its default."""
    from .config import Config

    saved = {**Config().flat(), **saved}
    keys = (set(saved) | set(current)) - RESUMABLE_CHANGES
    return sorted(k for k in keys if saved.get(k) != current.get(k))


def rng_state() -> dict[str, Any]:
    st = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict[str, Any]) -> None:
    torch.set_rng_state(st["torch"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


@dataclass
class Resumed:
    """What a run continues from: the checkpoint's state, its file, and the job's progress."""

    state: dict[str, Any]
    path: Path
    images: int             # images the job had applied
    best: float | None      # best test accuracy so far
    bad: set[str]           # unreadable files met so far


def resume(ckpt_dir: Path, cfg, model: torch.nn.Module, optimizer, distributed: bool,
           step_images: int) -> Resumed | None:
    """Load the newest checkpoint (the same in every process) into model, optimizer and RNG,
    after checking it was written with the same config; None when there is none."""
    found = load_agreed(ckpt_dir, distributed)
    if found is None:
        log.warning("--resume: no checkpoint in %s; starting from step 0", ckpt_dir)
        return None
    state, path = found
    current = cfg.flat()
    diff = config_differences(state["config"], current)
    if diff:
        raise CheckpointError(f"{path} was written with another config; differing keys: " + ", ".join(
            f"{k} ({state['config'].get(k)!r} -> {current.get(k)!r})" for k in diff))
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    set_rng_state(state["rng"])
    state.setdefault("images", state["step"] * step_images)  # checkpoints written before images were kept
    log.info("resumed from %s at step %d", path, state["step"])
    return Resumed(state, path, state["images"], state["best_test_accuracy"], set(state["bad"]))
