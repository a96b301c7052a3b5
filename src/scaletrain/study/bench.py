"""`scaletrain bench`: throughput of every combination of a grid, as result rows.

Each cell is a real `scaletrain train` run (single process, local launcher,
or Slurm inside an allocation) of warm-up + measured steps, with the first
`warmup` steps left out of the throughput; evaluation is off. One JSON row
per cell goes to OUT/bench.jsonl (resolved config, provenance, images/s with
standard error and jitter, bytes per step, staleness), then speedup and
efficiency (perfmodel/scaling.py) and the flags of figures in doubt (flags.py) are
added and the table printed and written to OUT/bench.md. Every cell's config
and placement is checked before the first one runs (grid.check_cells): a bad grid
value ends the sweep in one line.
Speedup is against one node with no distribution (scaling.BASELINE, every
other key the same): where the grid lacks that cell, it runs first, once
per distinct set of other keys, as a row marked `added_baseline`. A cell
that fails as it runs (an added baseline, which is not checked, or one
that needs more than this host has) is a row with its error; the others
still run. With --repeats R the grid runs R times over, pass after pass,
so that a slow spell of a shared host falls on every cell alike rather than on a few (OUT/cells/NAME-runJ; a cell whose run
fails is not run again, and rows are written in the last pass): the row's
images/s is the mean over runs, its standard error that of the mean of the
runs' own, and images_per_sec_runs / images_per_sec_run_stderr (std across runs / sqrt(R))
show how much separate runs differ, which log windows of one run cannot.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from ..config import load_config
from ..errors import ConfigError, Finished, GridError, Stopped
from ..perfmodel import scaling
from ..run import run_training
from . import figures, flags
from .grid import cell_sets, cells, check_cells, parse_grid
from .report import write_report

KEEP = ("strategy", "nodes", "nodes_total", "gpus_per_node", "num_ps", "ps_placement", "replicas", "stages",
        "pipeline", "peak_memory_bytes",
        "images_per_sec", "images_per_sec_stderr", "images_per_sec_mad", "slowest_window_fraction", "timed_windows",
        "data_wait_fraction",
        "bytes_per_step", "staleness_mean", "staleness_p95", "staleness_max", "dropped_gradients",
        "dropped_fraction", "gradients_per_update_mean", "emulated_workers", "emulated_compute_s", "not_applied",
        "git_commit", "host",
        "device", "torch_version",
        "python_version", "model", "parameters", "noise_scale")

# What every cell runs with whatever the recipe says (checked with the recipe before any cell runs).
IMPOSED = ("train.eval_every=0",)


def data_sets(data: str) -> list[str]:
    return ["data.name=synthetic"] if data == "synthetic" else []


def cell_name(i: int, cell: dict[str, str], data: str) -> str:
    parts = [f"{k.split('.')[-1]}-{v}" for k, v in cell.items()] + ([data] if data != "real" else [])
    return f"{i:03d}-" + "_".join(parts).replace("/", "-")


def run_cell(recipe: str, sets: list[str], out: Path, name: str, row: dict[str, Any]) -> dict[str, Any] | None:
    """One training run of the recipe with `sets` in OUT/cells/NAME; its summary, or None with
    row["error"] set. The row keeps the run directory relative to OUT, so OUT can be moved."""
    run_dir = out / "cells" / name
    t0 = time.perf_counter()
    summary = None
    try:
        summary = run_training(load_config(recipe, sets), run_dir, progress=False)
    except Finished:  # a sweep run again into its own OUT: a finished cell's figures are its summary's
        summary = json.loads((run_dir / "summary.json").read_text())
    except Stopped as e:  # a stop signal stops the sweep, not only its cell
        raise Stopped(f"cell {run_dir}: {e}", e.status) from None
    except Exception as e:  # noqa: BLE001 - one cell's failure is its row, the others still run
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    row.update(run_dir=f"cells/{name}", wall_seconds=time.perf_counter() - t0)
    return summary


def combine(runs: list[tuple[dict[str, Any], dict[str, Any] | None]], repeats: int,
            row: dict[str, Any]) -> dict[str, Any] | None:
    """A cell's runs (each run_cell's row part and summary) as one: the first run's summary with
    images_per_sec the mean over runs and images_per_sec_stderr the standard error of that mean
    from the runs' own; the spread across runs goes to row. None with row["error"] set when a run
    failed (the cell stopped repeating: a mean of the runs that worked would hide it)."""
    if repeats == 1:
        row.update(runs[0][0])
        return runs[0][1]
    row.update(run_dir=runs[0][0]["run_dir"], run_dirs=[p["run_dir"] for p, _ in runs],
               wall_seconds=sum(p["wall_seconds"] for p, _ in runs))
    if runs[-1][1] is None:
        row["error"] = f"run {len(runs)} of {repeats}: {runs[-1][0]['error']}"
        return None
    ips = [s["images_per_sec"] for _, s in runs]
    row["images_per_sec_runs"] = ips
    if not all(scaling.measured(s) for _, s in runs):  # a mean without that run would hide it
        return {**runs[0][1], "images_per_sec": None, "images_per_sec_stderr": None, "timed_windows": 0}
    within = [s.get("images_per_sec_stderr") or 0.0 for _, s in runs]
    slowest = [s["slowest_window_fraction"] for _, s in runs if s.get("slowest_window_fraction") is not None]
    row["images_per_sec_run_stderr"] = statistics.stdev(ips) / math.sqrt(repeats)
    return {**runs[0][1], "images_per_sec": statistics.fmean(ips),
            "images_per_sec_stderr": math.sqrt(sum(se * se for se in within)) / repeats,
            "slowest_window_fraction": min(slowest, default=None)}  # a stall in any run is in the mean


def baseline_cells(recipe: str, overrides: list[str], plan: list[tuple[dict[str, str], str]]) \
        -> list[tuple[dict[str, str], str]]:
    """The baseline cells (scaling.baseline_cell) that the (cell, data) plan lacks, once per data
    kind and distinct set of other keys. A cell whose config is invalid needs none: it will not run."""
    have, need = set(), {}
    for cell, data in plan:
        key = (data, tuple(sorted(scaling.rest(cell).items())))
        try:
            cfg = load_config(recipe, [*overrides, *(f"{k}={v}" for k, v in cell.items()), *IMPOSED])
        except ConfigError:
            continue
        if scaling.is_baseline(cfg.flat()):
            have.add(key)
        else:
            need.setdefault(key, (scaling.baseline_cell(cell, cfg.flat()), data))
    return [c for key, c in need.items() if key not in have]


def run(recipe: str, overrides: list[str], grid, warmup: int, steps: int,
        out: Path, pair_synthetic: bool = False, progress: bool = True, repeats: int = 1) -> list[dict[str, Any]]:
    plan = [(c, d) for c in cells(grid) for d in (("real", "synthetic") if pair_synthetic else ("real",))]
    timing = [f"train.steps={warmup + steps}", f"train.warmup_log_steps={warmup}", *IMPOSED,
              f"train.log_every={max(1, steps // 8)}"]
    # the grid's own cells only: an added baseline that cannot run is a row with its error, as before
    check_cells(recipe, overrides, [(c, [*timing, *data_sets(d)]) for c, d in plan])
    extra = baseline_cells(recipe, overrides, plan)  # run first: a sweep cut short still has its speedups
    plan = [(c, d, True) for c, d in extra] + [(c, d, False) for c, d in plan]
    out.mkdir(parents=True, exist_ok=True)
    runs: list[list] = [[] for _ in plan]  # per cell, (row part, summary) of each pass
    rows = []
    with open(out / "bench.jsonl", "w") as fh:
        for j in range(repeats):  # pass after pass, so that a slow spell of the host spreads over the cells
            for i, (cell, data, added) in enumerate(plan):
                label = ("baseline: " if added else "") + ", ".join(f"{k}={v}" for k, v in cell.items()) + \
                    ("" if data == "real" else " (synthetic data)")
                if not runs[i] or runs[i][-1][1] is not None:
                    print(f"[{i + 1}/{len(plan)}]{f' pass {j + 1}/{repeats}' if repeats > 1 else ''} {label}",
                          flush=True)
                    sets = cell_sets(overrides, cell, [*timing, *data_sets(data)])
                    name = cell_name(i, cell, data) + (f"-run{j + 1}" if repeats > 1 else "")
                    part: dict[str, Any] = {}
                    runs[i].append((part, run_cell(recipe, sets, out, name, part)))
                if j < repeats - 1:
                    continue
                row: dict[str, Any] = {"cell": cell, "data": data, "label": label}
                if added:
                    row["added_baseline"] = True
                s = combine(runs[i], repeats, row)
                if s is not None:
                    row.update({k: s.get(k) for k in KEEP})
                    row["config"] = _config(out / row["run_dir"])
                rows.append(row)
                fh.write(json.dumps(row) + "\n")
                fh.flush()
    rows = flags.add_flags(scaling.add_scaling(rows))
    publish(out, "bench", rows, figures.scaling_table(rows), progress)
    return rows


def publish(out: Path, kind: str, rows: list[dict[str, Any]], table: str, progress: bool) -> None:
    """OUT/KIND.md (the table), OUT/KIND-rows.json (what the report reads), then the report."""
    (out / f"{kind}.md").write_text(table + "\n")
    (out / f"{kind}-rows.json").write_text(json.dumps(rows, indent=1) + "\n")
    if progress:
        print(table)
    print(f"report: {write_report([out], out / 'report')}")


def _config(run_dir: Path) -> dict[str, Any]:
    return load_config(run_dir / "config.toml").flat()


def stopped(e: Stopped, rows: Path) -> int:
    """A sweep stopped by a signal: one line, and its exit status (75, or 130 for Ctrl-C)."""
    print(f"scaletrain: sweep stopped; {e}; the finished cells' rows are in {rows}", file=sys.stderr)
    return e.status


def flagged(rows: list[dict[str, Any]]) -> None:
    """One line per flagged row on stderr, so a doubted figure is seen even where the table is not read."""
    for r in rows:
        if r.get("flag"):
            print(f"scaletrain: flagged: {r['label']}: {r['flag']}", file=sys.stderr)


def main(args) -> int:
    out = Path(args.out or f"runs/bench-{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        grid = parse_grid(args.grid)
        if args.steps < 1 or args.warmup < 0 or args.repeats < 1:
            raise GridError(f"--steps {args.steps} --warmup {args.warmup} --repeats {args.repeats}: need "
                            "steps >= 1, warmup >= 0 and repeats >= 1")
        rows = run(args.recipe, args.overrides, grid, args.warmup, args.steps, out, args.pair_synthetic,
                   repeats=args.repeats)
    except GridError as e:  # raised before any cell runs (check_cells)
        print(f"scaletrain: error: {e}", file=sys.stderr)
        return 2
    except Stopped as e:
        return stopped(e, out / "bench.jsonl")
    print(f"bench: {sum(not r.get('error') for r in rows)}/{len(rows)} cells run; rows in {out / 'bench.jsonl'}")
    flagged(rows)
    return 1 if any(r.get("error") for r in rows) else 0
