"""Steps, images and hours to a target at another update size, from one measured run.

McCandlish et al. (2018): training to a target takes S = S_min (1 + B_noise / B) updates of B
images, and so E = E_min (1 + B / B_noise) images, with E_min = S_min B_noise; B_noise is the
gradient noise scale (noise.py measures it while training). One run to the target at B0 images per
update gives S_min = S0 / (1 + B_noise / B0), and from it the updates at any B: a larger update
costs fewer updates but more images once B passes B_noise. The hours are those images over the
configuration's predicted throughput (predict.py).

Asynchronous strategies apply stale gradients, which changes the updates to a target in ways the
noise scale does not say: their rows say so instead of a number. Evaluation time is not in the hours.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import Config, load_config
from ..schedule import step_images
from ..strategies import entry, images_per_update
from .predict import applied_rate
from .setup import ModelError

TARGETS = ("accuracy", "loss")  # --until: the test accuracy reached (eval rows) or the train loss (train rows)


@dataclass(frozen=True)
class Learning:
    """What one measured run says of the target: reached after `images`, at `update` images per update,
    with the gradient noise scale `noise_scale` measured there."""

    target: tuple[str, float]
    images: int
    update: int
    noise_scale: float
    source: str

    def updates_at(self, update: int) -> float:
        """Updates to the target at `update` images per update: S_min (1 + B_noise / B)."""
        s_min = self.images / self.update / (1 + self.noise_scale / self.update)
        return s_min * (1 + self.noise_scale / update)

    def describe(self) -> str:
        what, value = self.target
        return (f"{what} {value:g} after {self.images} images at {self.update} images per update, gradient noise "
                f"scale {self.noise_scale:.0f} ({self.source})")


def read_learning(run_dir: Path, target: tuple[str, float]) -> Learning:
    """The measured run in run_dir (summary.json, metrics.jsonl) to the target; ModelError of one line
    naming the file when it has no such point or no noise scale there."""
    what, value = target
    if what not in TARGETS:
        raise ModelError(f"--until {what}={value:g}: time to a target is of accuracy=A or loss=L")
    metrics = run_dir / "metrics.jsonl"
    try:
        cfg = load_config(run_dir / "config.toml")
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    except (OSError, ValueError) as e:
        raise ModelError(f"--learning {run_dir}: not a run's directory ({type(e).__name__}: {e})") from None
    if entry(cfg).server == "async" or entry(cfg).rounds:
        raise ModelError(f"--learning {run_dir}: a run of strategy.name = {cfg.strategy.name!r}, whose stale gradients "
                         "change the updates to a target; measure with a synchronous one (allreduce, sync)")
    update = images_per_update(cfg)
    if what == "accuracy":
        hits = [r for r in rows if r["kind"] == "eval" and r.get("test_accuracy", 0) >= value]
    else:
        hits = [r for r in rows if r["kind"] == "train" and r.get("loss", float("inf")) <= value]
    if not hits:
        raise ModelError(f"{metrics}: the run never reached {what} {value:g}; measure one that does (a longer run, "
                         "or train.target_accuracy / train.target_loss)")
    images = hits[0]["images"]
    noise = [r["noise_scale"] for r in rows if r["kind"] == "train" and "noise_scale" in r and r["images"] <= images]
    if not noise:
        raise ModelError(f"{metrics}: no gradient noise scale before the target (it is measured where backward "
                         "averages two or more replicas: run the measurement with 2 replicas or more)")
    return Learning(target, images, update, noise[-1], str(run_dir))


def add_target(row: dict[str, Any], cfg: Config, learning: Learning) -> dict[str, Any]:
    """The row (predict.py's, for cfg) with the updates, job steps, images and hours to the target; for an
    asynchronous strategy, why there are none."""
    if row.get("error"):
        return row
    e = entry(cfg)
    if e.server == "async" or e.rounds:
        row["target_note"] = "asynchronous: stale gradients change the updates to a target; not predicted"
        return row
    update = images_per_update(cfg)
    updates = learning.updates_at(update)
    images = updates * update
    row.update(target_updates=updates, target_images=images, target_steps=images / step_images(cfg),
               target_hours=images / applied_rate(row) / 3600)
    return row
