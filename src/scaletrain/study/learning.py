"""`scaletrain study`: learning, not just speed, for every configuration of a grid.

Each cell trains with evaluation on (the recipe's cadence) for the stop
criterion's length: `epochs=E` sets the run length; `accuracy=A` and
`loss=L` set train.target_accuracy / train.target_loss, so every process of
the run stops at the first evaluation point where the test accuracy reaches A
(or the replicas' mean train loss since the previous point falls to L); the
time and images to target are the job's at that point (the recipe's length
is the limit). Rows go to OUT/study.jsonl, the table (the study's shape:
Workers (GPUs) | Test accuracy | Time | Improvement) to OUT/study.md. Times are training time:
evaluation is left out, so its cadence does not count. Improvement = time
(or time to target, when one is set) of the baseline, the first cell with the
fewest replicas, over this cell's ("-" when either did not reach the target),
flagged (flags.py) when a throughput under it is in doubt or it passes its bound.

With --profile P the times are also read on P's clock: a cell's images over P's predicted
throughput for its configuration (perfmodel/predict.py), which is its job steps times P's step:
what the same training would take on P's hardware. With --bench DIR, on a bench's clock instead:
over the images/s the bench measured for the same configuration (emulated GPUs, for one). The
table, the improvement and the report's time plots then use that time, labelled with the clock's
name, and keep this machine's training time beside it; on a machine whose cores all of a cell's
processes share, that time says little of how the study's cluster scales.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from ..config import load_config
from ..errors import ConfigError, GridError, ModelError, ProfileError, Stopped, UntilError
from ..perfmodel.predict import applied_rate, predict
from ..perfmodel.profile import load_profile
from ..perfmodel.setup import check_workload
from . import bench, figures
from .grid import cell_sets, cells, check_cells, parse_grid


def parse_until(text: str | None) -> tuple[str, float] | None:
    if not text:
        return None
    what, sep, value = text.partition("=")
    try:
        v = float(value)
    except ValueError:
        v = None
    if not sep or what not in ("epochs", "loss", "accuracy") or v is None or v <= 0:
        raise UntilError(f"--until {text!r}: write epochs=E, loss=L or accuracy=A (a positive number)")
    return what, v


def until_sets(until: tuple[str, float] | None) -> list[str]:
    """The config overrides --until stands for: the run's length, or its target."""
    what, value = until or (None, None)
    return {"epochs": [f"train.epochs={value}", "train.steps=0"], "accuracy": [f"train.target_accuracy={value}"],
            "loss": [f"train.target_loss={value}"], None: []}[what]


# What a bench row's configuration is, for a study cell to find its throughput there.
SAME = ("model.name", "model.args", "data.image_size", "data.batch_size", "strategy.name", "strategy.backup_workers",
        "cluster.nodes", "cluster.gpus_per_node", "cluster.num_ps", "cluster.ps_placement", "cluster.sharding")


class Clock:
    """Another clock for a study's times: a profile's predictions (--profile) or a bench's
    measurements (--bench). rate(cfg) is the images/s it gives cfg's configuration, counting only
    gradients applied (a backup's dropped ones are not)."""

    def __init__(self, profile: str | None = None, bench_dir: str | None = None) -> None:
        if profile:
            self.name, self.prof = f"profile {Path(profile).stem} (predicted)", load_profile(profile)[0]
        else:
            path = Path(bench_dir) / "bench-rows.json"
            try:
                self.rows = [r for r in json.loads(path.read_text()) if not r.get("error") and r.get("images_per_sec")]
            except (OSError, ValueError) as e:
                raise ConfigError(f"--bench {bench_dir}: no bench rows to read ({path}: {e})") from None
            self.name, self.prof = f"bench {bench_dir} (measured)", None

    def rate(self, cfg) -> float:
        if self.prof is not None:
            return applied_rate(predict(cfg, self.prof))
        want = {k: cfg.flat()[k] for k in SAME}
        for r in self.rows:
            if {k: r["config"].get(k) for k in SAME} == want:
                return applied_rate(r)
        raise ConfigError(f"{self.name} has no row of this configuration ("
                          + ", ".join(f"{k}={want[k]}" for k in SAME[4:]) + "): bench the study's grid first")

    def times(self, row: dict[str, Any], cfg) -> dict[str, Any]:
        """The row's times on this clock: its images over the clock's images/s for cfg."""
        rate = self.rate(cfg)
        to_target = row.get("images_to_target")
        return {"clock": self.name, "clock_images_per_sec": rate, "clock_seconds": row["images_applied"] / rate,
                "clock_time_to_target": None if to_target is None else to_target / rate}


def run(recipe: str, overrides: list[str], grid, until: tuple[str, float] | None, out: Path,
        progress: bool = True, clock: Clock | None = None) -> list[dict[str, Any]]:
    length = until_sets(until)
    rows = []
    todo = cells(grid)
    check_cells(recipe, overrides, [(c, length) for c in todo])
    if clock is not None:  # a cell the clock cannot time: refused before any run
        for c in todo:
            clock.rate(load_config(recipe, cell_sets(overrides, c, length)))
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "study.jsonl", "w") as fh:
        for i, cell in enumerate(todo):
            label = ", ".join(f"{k}={v}" for k, v in cell.items())
            print(f"[{i + 1}/{len(todo)}] {label}", flush=True)
            row: dict[str, Any] = {"cell": cell, "label": label, "until": list(until) if until else None}
            s = bench.run_cell(recipe, cell_sets(overrides, cell, length), out,
                               bench.cell_name(i, cell, "real"), row)
            if s is not None:
                row.update({k: s.get(k) for k in bench.KEEP})
                row.update(steps=s["steps"], epochs=s["epochs"], wall_seconds=s["wall_seconds"],
                           train_seconds=s["train_seconds"], images_applied=s["images_applied"],
                           test_accuracy=s.get("test_accuracy"), best_test_accuracy=s.get("best_test_accuracy"),
                           final_train_loss=s["final_train_loss"], time_to_target=s.get("time_to_target"),
                           images_to_target=s.get("images_to_target"))
                if clock is not None:
                    row.update(clock.times(row, load_config(recipe, cell_sets(overrides, cell, length))))
            rows.append(row)
            fh.write(json.dumps(row) + "\n")
            fh.flush()
    rows = figures.add_improvement(rows, until)
    found = "".join(f"\n- {line}" for line in figures.findings(rows, until))
    bench.publish(out, "study", rows, figures.study_table(rows, until) + (f"\n\nFindings:\n{found}" if found else ""),
                  progress)
    return rows


def main(args) -> int:
    out = Path(args.out or f"runs/study-{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        grid = parse_grid(args.grid)
        until = parse_until(args.until)
        cfg = load_config(args.recipe, [*args.overrides, *until_sets(until)])  # e.g. a target with no evaluations
        if args.profile and args.bench:
            raise ConfigError("--profile or --bench: one clock for the study's times")
        clock = Clock(args.profile, args.bench) if args.profile or args.bench else None
        if args.profile:  # a profile of another network or image size: refused before any run
            check_workload(cfg, clock.prof, args.profile)
        rows = run(args.recipe, args.overrides, grid, until, out,  # a bad cell: GridError before any runs
                   clock=clock)
    except (GridError, UntilError, ConfigError, ProfileError, ModelError) as e:
        print(f"scaletrain: error: {e}", file=sys.stderr)
        return 2
    except Stopped as e:
        return bench.stopped(e, out / "study.jsonl")
    print(f"study: {sum(not r.get('error') for r in rows)}/{len(rows)} configurations trained; rows in "
          f"{out / 'study.jsonl'}")
    bench.flagged(rows)
    return 1 if any(r.get("error") for r in rows) else 0
