"""Steps, images and hours to a target at another update size, from one measured run.

McCandlish et al. (2018): training to a target takes S = S_min (1 + B_noise / B) updates of B
images, and so E = E_min (1 + B / B_noise) images, with E_min = S_min B_noise; B_noise is the
gradient noise scale (noise.py measures it while training). One run to the target at B0 images per
update gives S_min = S0 / (1 + B_noise / B0), and from it the updates at any B: a larger update
costs fewer updates but more images once B passes B_noise. The law holds where the learning rate
follows the update as it assumes: optim.scale_lr = noise (optim.py), the rule a run to be predicted
trains with. The hours are those images over the configuration's predicted throughput (predict.py),
plus the evaluations on the way: train.eval_every's, each a forward pass over the measured run's
test images shared by the replicas, a forward taken as a third of a training step's compute.

Asynchronous parameter servers apply stale gradients: an update computed tau versions back moves
the values less far towards the target than a fresh one. The model: at mean staleness tau the
updates to the target are the synchronous ones times g^tau, each version of delay costing the same
factor g, fitted from runs of the one-process emulator (strategy.emulate_workers = K: every gradient
K-1 versions stale) to the same target, given beside the synchronous run (the geometric mean of
their (updates / synchronous updates)^(1/tau)). On digits the emulator at staleness 3 and at 4 gives
about the same g, where a cost linear in tau would not. tau is the staleness the simulation predicts
for the configuration (predict.py), up to the largest staleness an emulator run had: past it stale
updates can diverge, which a factor fitted below it does not say. Rounds of asynchronous all-reduce
are not predicted.

The noise scale measured along one run can under-read the batch the law needs (a BN-free network on
digits read 8.6 images where its runs' updates fell as for a larger one). Synchronous runs at two or
more update sizes give the law's critical batch directly: S is a line in 1 / B (fitted()).

How sure (bands.py): several synchronous runs of one configuration, seeds, give their median
images to the target and noise scale, and their spread (max - min) / median, a half-width of
spread / 2 on the updates as a profile's spread gives. A target accuracy p read on n test images
is itself off by the binomial standard error sqrt(p (1 - p) / n); the run's learning curve turns
that into images: over the secant from the evaluation before the crossing to the crossing, an
accuracy sigma higher or lower is reached sigma / slope images later or sooner. A loss target is
the training batches' loss, with no test set: no such term. Both are relative half-widths on the
updates at the run's update size, carried to the others as they are (the noise scale's own
uncertainty is left out), and combined in quadrature.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, replace
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
    """What measured runs say of the target: reached after `images`, at `update` images per update,
    with the gradient noise scale `noise_scale` measured there; `staleness_factor` g from emulator runs
    (None without one), and the test images an evaluation reads."""

    target: tuple[str, float]
    images: int
    update: int
    noise_scale: float
    source: str
    staleness_factor: float | None = None
    staleness_max: float = 0.0  # the most staleness an emulator run measured: the cost is not extrapolated past it
    test_images: int = 0
    seeds: int = 1  # synchronous runs of the one configuration
    seed_spread: float = 0.0  # their images to the target: (max - min) / median
    eval_error: float = 0.0  # the test set's standard error on the target accuracy, as a fraction of the images
    fitted_updates: tuple[int, ...] = ()  # update sizes the law was fitted to (fitted()); () = one, with its noise scale

    def band(self) -> float:
        """The relative half-width of the updates to the target: the seeds' spread / 2 and the
        evaluation's error in quadrature (0: nothing to say)."""
        return math.hypot(self.seed_spread / 2, self.eval_error)

    def updates_at(self, update: int, staleness: float = 0.0) -> float:
        """Updates to the target at `update` images per update, at mean staleness `staleness`:
        S_min (1 + B_noise / B) g^tau."""
        s_min = self.images / self.update / (1 + self.noise_scale / self.update)
        stale = (self.staleness_factor or 1.0) ** staleness
        return s_min * (1 + self.noise_scale / update) * stale

    def describe(self) -> str:
        what, value = self.target
        cost = "" if self.staleness_factor is None else (f", {self.staleness_factor:.2f}x the updates a version of "
                                                         f"staleness, up to staleness {self.staleness_max:.1f}")
        seeds = f", {self.seeds} seeds spread {self.seed_spread:.0%}" if self.seeds > 1 else ""
        evals = f", test-set error +-{self.eval_error:.1%} of the images" if self.eval_error else ""
        scale = (f"critical batch {self.noise_scale:.0f} fitted to runs at {', '.join(map(str, self.fitted_updates))} "
                 "images per update" if self.fitted_updates else f"gradient noise scale {self.noise_scale:.0f}")
        return (f"{what} {value:g} after {self.images} images at {self.update} images per update, {scale}"
                f"{cost}{seeds}{evals} ({self.source})")


def _read_run(run_dir: Path, target: tuple[str, float]):
    """(config, rows, summary, images to the target) of the run in run_dir; ModelError naming the file."""
    what, value = target
    metrics = run_dir / "metrics.jsonl"
    try:
        cfg = load_config(run_dir / "config.toml")
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    except (OSError, ValueError) as e:
        raise ModelError(f"--learning {run_dir}: not a run's directory ({type(e).__name__}: {e})") from None
    if what == "accuracy":
        hits = [r for r in rows if r["kind"] == "eval" and r.get("test_accuracy", 0) >= value]
    else:
        hits = [r for r in rows if r["kind"] == "train" and r.get("loss", float("inf")) <= value]
    if not hits:
        raise ModelError(f"{metrics}: the run never reached {what} {value:g}; measure one that does (a longer run, "
                         "or train.target_accuracy / train.target_loss)")
    return cfg, rows, summary, hits[0]["images"]


def read_learning(run_dirs: Path | list[Path], target: tuple[str, float]) -> Learning:
    """The measured runs to the target: one synchronous run (its noise scale, its updates to the target)
    and any emulator runs (strategy.emulate_workers: the staleness cost, their mean). ModelError of one
    line naming the file when a run has no such point or no noise scale there."""
    what, value = target
    if what not in TARGETS:
        raise ModelError(f"--until {what}={value:g}: time to a target is of accuracy=A or loss=L")
    runs = [run_dirs] if isinstance(run_dirs, Path) else list(run_dirs)
    sync, emulated = [], []
    for run_dir in runs:
        read = _read_run(run_dir, target)
        cfg = read[0]
        if cfg.strategy.emulate_workers and not entry(cfg).rounds:
            emulated.append((run_dir, read))
        elif entry(cfg).server == "async" or entry(cfg).rounds or entry(cfg).local:
            raise ModelError(f"--learning {run_dir}: a run of strategy.name = {cfg.strategy.name!r}"
                             f"{' (emulated rounds)' if cfg.strategy.emulate_workers else ''}, whose stale or local "
                             "steps change the updates to a target; measure with a synchronous one (allreduce, sync) and, "
                             "for asynchronous parameter servers, the emulator (strategy.emulate_workers = K)")
        else:
            sync.append((run_dir, read))
    base = synchronous(sync, runs, target)
    costs, taus = [], [0.0]
    for run_dir, (ecfg, _, esummary, eimages) in emulated:
        tau = esummary.get("staleness_mean")
        if not tau:
            raise ModelError(f"{run_dir / 'summary.json'}: no staleness_mean; an emulator run with "
                             "strategy.emulate_workers >= 2 that finished")
        update = images_per_update(ecfg)
        costs.append(math.log(eimages / update / base.updates_at(update)) / tau)
        taus.append(tau)
    factor = math.exp(max(0.0, sum(costs) / len(costs))) if costs else None
    return replace(base, staleness_factor=factor, staleness_max=max(taus), source=", ".join(map(str, runs)))


def synchronous(sync: list, runs: list[Path], target: tuple[str, float]) -> Learning:
    """The Learning of the synchronous runs (seeds of one configuration): their median images to
    the target and noise scale, their spread, and the median of their evaluations' errors."""
    if not sync:
        raise ModelError(f"--learning: no synchronous run among {', '.join(map(str, runs))}; give one, or several "
                         "seeds of one (with emulator runs beside it, if any)")
    updates = {images_per_update(read[0]) for _, read in sync}
    if len(updates) > 1:
        return fitted([synchronous([r for r in sync if images_per_update(r[1][0]) == u], runs, target)
                       for u in sorted(updates)])
    images, noises, errors = [], [], []
    for run_dir, (cfg, rows, summary, reached) in sync:
        noise = [r["noise_scale"] for r in rows
                 if r["kind"] == "train" and "noise_scale" in r and r["images"] <= reached]
        if not noise:
            raise ModelError(f"{run_dir / 'metrics.jsonl'}: no gradient noise scale before the target (it is measured "
                             "where backward averages two or more replicas, or in one replica with train.noise_every "
                             "= N)")
        images.append(reached)
        noises.append(summary.get("noise_scale") or noise[-1])
        errors.append(eval_error(rows, target, reached, summary.get("test_images", 0)))
    middle = statistics.median(images)
    return Learning(target, middle, updates.pop(), statistics.median(noises), ", ".join(str(d) for d, _ in sync),
                    test_images=sync[0][1][2].get("test_images", 0), seeds=len(sync),
                    seed_spread=(max(images) - min(images)) / middle, eval_error=statistics.median(errors))


def fitted(points: list[Learning]) -> Learning:
    """The law fitted to synchronous runs at two or more update sizes B_i (each the median of its
    seeds): S = S_min + S_min B_crit / B is a line in 1 / B, so least squares gives S_min (its
    intercept) and B_crit (slope over intercept), the critical batch the runs themselves show, in
    place of the noise scale measured along the way (which reads low on some networks). The
    Learning is the fit's at the smallest update, its noise_scale B_crit; its spread the largest of
    the points' seeds' spreads and of the fit's residuals."""
    xs = [1 / p.update for p in points]
    ys = [p.images / p.update for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    s_min = my - slope * mx
    where = ", ".join(f"{p.update} ({p.source})" for p in points)
    if s_min <= 0 or slope < 0:
        raise ModelError(f"--learning: runs at {where} images per update do not follow S = S_min (1 + B_crit / B) "
                         f"(fit: S_min {s_min:.0f}, slope {slope:.0f}): a larger update should take fewer updates, "
                         "but not fewer images; check that each trained with optim.scale_lr = noise")
    crit, low = slope / s_min, points[0]
    residual = max(abs(s_min * (1 + crit / p.update) / (p.images / p.update) - 1) for p in points)
    return replace(low, images=round(s_min * (1 + crit / low.update) * low.update), noise_scale=crit,
                   source=f"law fitted to {len(points)} update sizes: {where}", fitted_updates=tuple(p.update for p in points),
                   seeds=sum(p.seeds for p in points), seed_spread=max([residual * 2, *(p.seed_spread for p in points)]))


def eval_error(rows: list[dict[str, Any]], target: tuple[str, float], reached: int, test_images: int) -> float:
    """The images by which the test set's sampling error moves the crossing of a target accuracy, as a
    fraction of `reached`: sqrt(p (1 - p) / n) over the slope of the secant from the evaluation
    before the crossing to it. 0 for a loss target, an unknown test set, or no evaluation before."""
    what, p = target
    evals = [r for r in rows if r["kind"] == "eval" and "test_accuracy" in r and r["images"] <= reached]
    if what != "accuracy" or not test_images or len(evals) < 2:
        return 0.0
    before, hit = evals[-2], evals[-1]
    slope = (hit["test_accuracy"] - before["test_accuracy"]) / max(hit["images"] - before["images"], 1)
    if slope <= 0:
        return 0.0
    return math.sqrt(p * (1 - p) / test_images) / slope / reached


def add_target(row: dict[str, Any], cfg: Config, learning: Learning) -> dict[str, Any]:
    """The row (predict.py's, for cfg) with the updates, job steps, images and hours to the target,
    evaluations included; for an asynchronous strategy without a staleness cost, why there are none."""
    if row.get("error"):
        return row
    e = entry(cfg)
    if e.rounds or e.local:
        row["target_note"] = (f"{'asynchronous rounds' if e.rounds else 'local steps between meetings'}: stale "
                              "gradients change the updates to a target; not predicted")
        return row
    staleness = (row.get("staleness_mean") or 0.0) if e.server == "async" else 0.0
    if e.server == "async" and learning.staleness_factor is None:
        row["target_note"] = ("asynchronous: not predicted without an emulator run to the target in --learning "
                              "(strategy.emulate_workers = K)")
        return row
    if staleness > learning.staleness_max * 1.05:  # stale updates can diverge where the emulator ran none
        row["target_note"] = (f"staleness {staleness:.1f}: beyond the emulator runs' {learning.staleness_max:.1f}; "
                              f"not predicted (give one at strategy.emulate_workers >= {math.ceil(staleness) + 1})")
        return row
    update = images_per_update(cfg)
    updates = learning.updates_at(update, staleness)
    images = updates * update
    steps = images / step_images(cfg)
    evals = int(steps // cfg.train.eval_every) if cfg.train.eval_every else 0
    # a forward pass: a third of the compute of a step of batch_per_replica images (times the micro-batches an
    # update accumulates), its share of the test set
    per_update = row["batch_per_replica"] * row.get("grad_accum_steps", 1)
    eval_s = evals * learning.test_images / row["replicas"] / per_update * row["parts_s"]["compute"] / 3
    row.update(target_updates=updates, target_images=images, target_steps=steps,
               target_hours=(images / applied_rate(row) + eval_s) / 3600, target_eval_hours=eval_s / 3600)
    return row
