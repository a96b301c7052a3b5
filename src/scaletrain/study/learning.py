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
what the same training would take on P's hardware. The table and the improvement then use that
time, labelled with P's name, and keep this machine's wall time beside it; on a machine whose
cores all the cells' processes share, wall time says little of how the study's cluster scales.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from ..config import load_config
from ..errors import ConfigError, GridError, ModelError, ProfileError, Stopped, UntilError
from ..perfmodel.predict import predict
from ..perfmodel.profile import Profile, load_profile
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


def on_profile(row: dict[str, Any], cfg, prof: Profile, name: str) -> dict[str, Any]:
    """The row's times on the profile's clock: its images over the profile's predicted throughput
    for cfg, counting only the gradients applied (a backup's dropped ones are not)."""
    predicted = predict(cfg, prof)
    rate = predicted["images_per_sec"] * (1 - predicted["dropped_fraction"])
    to_target = row.get("images_to_target")
    return {"profile": name, "profile_images_per_sec": rate, "profile_seconds": row["images_applied"] / rate,
            "profile_time_to_target": None if to_target is None else to_target / rate}


def run(recipe: str, overrides: list[str], grid, until: tuple[str, float] | None, out: Path,
        progress: bool = True, profile: str | None = None) -> list[dict[str, Any]]:
    length = until_sets(until)
    rows = []
    todo = cells(grid)
    check_cells(recipe, overrides, [(c, length) for c in todo])
    prof = load_profile(profile)[0] if profile else None
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
                if prof is not None:
                    row.update(on_profile(row, load_config(recipe, cell_sets(overrides, cell, length)), prof,
                                          Path(profile).stem))
            rows.append(row)
            fh.write(json.dumps(row) + "\n")
            fh.flush()
    rows = figures.add_improvement(rows, until)
    bench.publish(out, "study", rows, figures.study_table(rows, until), progress)
    return rows


def main(args) -> int:
    out = Path(args.out or f"runs/study-{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        grid = parse_grid(args.grid)
        until = parse_until(args.until)
        cfg = load_config(args.recipe, [*args.overrides, *until_sets(until)])  # e.g. a target with no evaluations
        if args.profile:  # a profile of another network or image size: refused before any run
            check_workload(cfg, load_profile(args.profile)[0], args.profile)
        rows = run(args.recipe, args.overrides, grid, until, out,  # a bad cell: GridError before any runs
                   profile=args.profile)
    except (GridError, UntilError, ConfigError, ProfileError, ModelError) as e:
        print(f"scaletrain: error: {e}", file=sys.stderr)
        return 2
    except Stopped as e:
        return bench.stopped(e, out / "study.jsonl")
    print(f"study: {sum(not r.get('error') for r in rows)}/{len(rows)} configurations trained; rows in "
          f"{out / 'study.jsonl'}")
    bench.flagged(rows)
    return 1 if any(r.get("error") for r in rows) else 0
