"""The study's figures from result rows: speedup, efficiency and their uncertainty.

Definitions (as the study's): speedup = throughput / throughput of the
baseline, the 1-node configuration of the same strategy; efficiency =
speedup / nodes used, dedicated PS nodes included. Uncertainties are standard
errors; a ratio's relative error is the root sum of squares of its parts'.

Pure functions over dicts: no torch, no files.
"""

from __future__ import annotations

import math
from typing import Any

# Keys that may differ between a configuration and its 1-node baseline.
SCALING_KEYS = ("cluster.nodes", "cluster.num_ps", "cluster.ps_placement", "strategy.backup_workers")


def baseline(row: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The 1-node row of the same strategy and data that differs only in the scaling keys;
    None when the grid has none (then no speedup is claimed)."""
    same = [r for r in rows if not r.get("error") and r["nodes"] == 1 and r["strategy"] == row["strategy"]
            and r.get("data") == row.get("data") and _rest(r) == _rest(row)]
    return same[0] if same else None


def _rest(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.get("cell", {}).items() if k not in SCALING_KEYS}


def ratio(a: float, a_se: float, b: float, b_se: float) -> tuple[float, float]:
    """a / b and its standard error."""
    r = a / b
    return r, abs(r) * math.hypot(a_se / a if a else 0.0, b_se / b if b else 0.0)


def add_scaling(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows with speedup, speedup_stderr and efficiency (None where no baseline)."""
    out = []
    for orig in rows:
        row = dict(orig)
        base = None if row.get("error") else baseline(row, rows)
        if base is None or not base["images_per_sec"]:
            row.update(speedup=None, speedup_stderr=None, efficiency=None, baseline=None)
        else:
            s, se = (1.0, 0.0) if base is orig else \
                ratio(row["images_per_sec"], row.get("images_per_sec_stderr") or 0.0,
                      base["images_per_sec"], base.get("images_per_sec_stderr") or 0.0)
            row.update(speedup=s, speedup_stderr=se, efficiency=s / row["nodes_total"], baseline=setup(base))
        out.append(row)
    return out


def setup(row: dict[str, Any]) -> str:
    """'mixed-async, 7 nodes (4 workers + 3 dedicated PS)' in the study's words (a worker is
    a node's worker; 'x 2 replicas' when it drives several GPUs)."""
    n, total, ps = row["nodes"], row["nodes_total"], row.get("num_ps", 0)
    where = "" if not ps else f" + {ps} {'dedicated ' if row.get('ps_placement') == 'dedicated' else ''}PS" + \
        ("" if row.get("ps_placement") == "dedicated" else " alongside")
    data = f", {row['data']} data" if row.get("data") not in (None, "real") else ""
    g = row.get("gpus_per_node") or 1
    per = f" x {g} replicas" if g > 1 else ""
    emulated = f", emulating {row['emulated_workers']} workers" if row.get("emulated_workers") else ""
    other = "".join(f", {k}={v}" for k, v in _rest(row).items() if k != "strategy.name")  # the grid's other keys
    return (f"{row['strategy']}, {total} node{'s' if total > 1 else ''} "
            f"({n} worker{'s' if n > 1 else ''}{per}{where}){emulated}{other}{data}")


def scaling_table(rows: list[dict[str, Any]]) -> str:
    """Markdown: Setup | Throughput | Speedup | Efficiency (rows as given, with add_scaling)."""
    lines = ["| Setup | Throughput (img/s) | Speedup | Efficiency |", "|---|---|---|---|"]
    for r in rows:
        if r.get("error"):
            lines.append(f"| {r.get('label', '?')} | not run: {r['error']} | | |")
            continue
        thr = f"{r['images_per_sec']:.1f} ± {r.get('images_per_sec_stderr') or 0:.1f}"
        sp = "-" if r.get("speedup") is None else f"{r['speedup']:.2f} ± {r['speedup_stderr']:.2f}"
        eff = "-" if r.get("efficiency") is None else f"{r['efficiency']:.2f}"
        lines.append(f"| {setup(r)} | {thr} | {sp} | {eff} |")
    return "\n".join(lines)
