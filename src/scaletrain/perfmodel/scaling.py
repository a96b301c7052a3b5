"""The study's definitions of speedup and efficiency, and their uncertainty, over result rows.

Definitions (the study's, used alike by bench, report, predict and predict --validate):
- baseline: ONE node with NO distribution: the same replicas per node
  (cluster.gpus_per_node), averaged inside the node by all-reduce, no PS
  (`BASELINE`: strategy.name = allreduce, cluster.nodes = 1, cluster.num_ps = 0),
  every other key the same (model, data, batch, ...). A PS strategy on one node
  is measured against it too, so its PS's cost shows as a speedup below 1;
- speedup = throughput / the baseline's throughput;
- efficiency = speedup / nodes used, dedicated PS nodes included;
- speedup vs own smallest (a second, labelled figure): throughput / that of the
  same strategy's configuration with the fewest nodes, other keys the same.
Uncertainties are standard errors; a ratio's relative error is the root sum of
squares of its parts'.

They live in the performance model, not in the study that measures them: a prediction and its
validation against a bench must use the very definitions the bench uses, and the model is the
layer below the study. The study's tables of these figures are study/figures.py.

Pure functions over dicts: no torch, no files.
"""

from __future__ import annotations

import math
from typing import Any

from ..config import StrategyConfig

# The baseline's settings; the rest of its config is the configuration's own.
BASELINE: dict[str, Any] = {"strategy.name": "allreduce", "cluster.nodes": 1, "cluster.num_ps": 0,
                            "strategy.backup_workers": 0, "strategy.slow_node": -1}
# Keys read by other strategies than all-reduce alone: a configuration's baseline has them at their
# defaults (all-reduce refuses them set), and it may differ from its baseline in them.
STRATEGY_KEYS = {f"strategy.{k}": StrategyConfig.__dataclass_fields__[k].default
                 for k in ("async_bound", "sync_every", "outer_lr", "outer_momentum")}
# Keys that only say how the job is distributed: a configuration and its baseline may differ in them.
DISTRIBUTION_KEYS = (*BASELINE, *STRATEGY_KEYS, "cluster.ps_placement", "cluster.sharding", "strategy.slow_delay_s")
# Keys that setup() already shows in words.
_SHOWN = ("strategy.name", "cluster.nodes", "cluster.num_ps", "cluster.ps_placement", "train.emulate_compute_s")


def baseline_sets(settings: dict[str, Any]) -> dict[str, Any]:
    """The baseline's settings for a configuration (its flat config): BASELINE's, and STRATEGY_KEYS
    that it sets away from their defaults back at them."""
    return {**BASELINE, **{k: v for k, v in STRATEGY_KEYS.items() if settings.get(k, v) != v}}


def baseline_cell(cell: dict[str, str], settings: dict[str, Any] | None = None) -> dict[str, str]:
    """The grid cell of a cell's baseline: its other keys, with the baseline's settings (baseline_sets
    of the cell's flat config, when given)."""
    return {**rest(cell), **{k: str(v) for k, v in baseline_sets(settings or {}).items()}}

def is_baseline(settings: dict[str, Any]) -> bool:
    """Whether a flat config has the baseline's settings (a key it lacks counts as the baseline's)."""
    return all(settings.get(k, v) == v for k, v in BASELINE.items())

def _ran_baseline(row: dict[str, Any]) -> bool:
    """Whether a result row ran the baseline: its summary fields, and its resolved config for the rest."""
    return is_baseline({**(row.get("config") or {}), "strategy.name": row["strategy"], "cluster.nodes": row["nodes"],
                        "cluster.num_ps": row.get("num_ps") or 0})

def rest(cell: dict[str, str]) -> dict[str, str]:
    """A grid cell without its distribution keys: what a configuration and its baseline share."""
    return {k: v for k, v in cell.items() if k not in DISTRIBUTION_KEYS}

def _same_work(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Same data kind, emulated compute, replicas per node and non-distribution grid keys."""
    return (a.get("data") == b.get("data") and (a.get("gpus_per_node") or 1) == (b.get("gpus_per_node") or 1)
            and (a.get("emulated_compute_s") or 0) == (b.get("emulated_compute_s") or 0)
            and rest(a.get("cell", {})) == rest(b.get("cell", {})))

def baseline(row: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The row of row's baseline (the first measured one); None when rows have none (then no
    speedup is claimed)."""
    return next((r for r in rows if not r.get("error") and _ran_baseline(r) and _same_work(r, row)), None)

def own_smallest(row: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The measured row of the same strategy and other keys with the fewest nodes used
    (then the fewest worker nodes, then the first)."""
    same = [r for r in rows if not r.get("error") and r["strategy"] == row["strategy"] and _same_work(r, row)]
    return min(same, key=lambda r: (r["nodes_total"], r["nodes"])) if same else None

def measured(row: dict[str, Any]) -> bool:
    """Whether a row's throughput was measured: a run with no timed window has none (null; 0.0
    in summaries written before nulls)."""
    return row.get("images_per_sec") is not None and row.get("timed_windows") != 0

def ratio(a: float, a_se: float, b: float, b_se: float) -> tuple[float, float]:
    """a / b and its standard error."""
    r = a / b
    return r, abs(r) * math.hypot(a_se / a if a else 0.0, b_se / b if b else 0.0)

def throughput_se(row: dict[str, Any]) -> float:
    """A row's throughput uncertainty: the larger of the standard error within its runs and,
    with repeats, that across them (so neither a quiet run nor a lucky pair hides the spread)."""
    return max(row.get("images_per_sec_stderr") or 0.0, row.get("images_per_sec_run_stderr") or 0.0)

def scaling(images_per_sec: float, se: float, base_images_per_sec: float, base_se: float,
            nodes_total: int) -> dict[str, float]:
    """Speedup, its standard error and efficiency of a throughput against its baseline's."""
    s, s_se = ratio(images_per_sec, se, base_images_per_sec, base_se)
    return {"speedup": s, "speedup_stderr": s_se, "efficiency": s / nodes_total}

def add_scaling(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows with speedup, speedup_stderr, efficiency and baseline (the baseline's setup), and
    speedup_own, speedup_own_stderr and own_baseline against the same strategy's smallest
    configuration; None where there is none."""
    out = []
    for orig in rows:
        row = dict(orig)
        for name, find, keys in (("baseline", baseline, ("speedup", "speedup_stderr", "efficiency")),
                                 ("own_baseline", own_smallest, ("speedup_own", "speedup_own_stderr"))):
            base = None if row.get("error") or not measured(row) else find(orig, rows)
            if base is None or not measured(base):
                row.update(dict.fromkeys(keys), **{name: None})
                continue
            if base is orig:  # exactly 1 with no uncertainty: a row against itself
                fig = {"speedup": 1.0, "speedup_stderr": 0.0, "efficiency": 1.0 / row["nodes_total"]}
            else:
                fig = scaling(row["images_per_sec"], throughput_se(row), base["images_per_sec"],
                              throughput_se(base), row["nodes_total"])
            row.update(dict(zip(keys, (fig["speedup"], fig["speedup_stderr"], fig["efficiency"]))),
                       **{name: setup(base)})
        out.append(row)
    return out

def setup(row: dict[str, Any]) -> str:
    """'mixed-async, 7 nodes (4 workers + 3 dedicated PS)' in the study's words (a worker is
    a node's worker; 'x 2 replicas' when it drives several GPUs)."""
    n, total, ps = row["nodes"], row["nodes_total"], row.get("num_ps", 0)
    where = "" if not ps else f" + {ps} {'dedicated ' if row.get('ps_placement') == 'dedicated' else ''}PS" + \
        ("" if row.get("ps_placement") == "dedicated" else " alongside")
    data = f", {row['data']} data" if row.get("data") not in (None, "real") else ""
    g, s = row.get("gpus_per_node") or 1, row.get("stages") or 1
    per = (f" x {g // s} replicas" if g // s > 1 else "") + (f" of {s} stages" if s > 1 else "")
    emulated = f", emulating {row['emulated_workers']} workers" if row.get("emulated_workers") else ""
    emulated += emulated_compute(row)
    other = "".join(f", {k}={v}" for k, v in row.get("cell", {}).items()  # the grid's other keys, but
                    if k not in _SHOWN and str({**BASELINE, **STRATEGY_KEYS}.get(k)) != v)  # nor the baseline's
    return (f"{row['strategy']}, {total} node{'s' if total > 1 else ''} "
            f"({n} worker{'s' if n > 1 else ''}{per}{where}){emulated}{other}{data}")

def emulated_compute(row: dict[str, Any]) -> str:
    """', emulated compute 0.2 s' for a row whose replicas emulated their GPUs (train.emulate_compute_s)."""
    t = row.get("emulated_compute_s")
    return f", emulated compute {t:g} s" if t else ""
