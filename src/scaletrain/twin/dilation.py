"""A twin job's figures at the cluster's speed.

Under cluster.time_scale = k the twin runs k times slower than the cluster it stands for (emulated
compute k times longer, links k times slower: compute.Emulated, launch/local.py), so every duration
it measures is k times the cluster's and every rate 1/k of it. The summary reports the cluster's:
durations divided by k, rates multiplied by k, and says so in its `twin` section, with the link's
set and measured rates (RUN_DIR/logs/twin.json, from the launcher). metrics.jsonl's rows and the progress
line are the cluster's too (cluster_row)."""

from __future__ import annotations

import json
from pathlib import Path

KEPT = {"emulated_compute_s"}  # the configuration's own value: already the cluster's


def _scaled(key: str, value, k: float):
    if isinstance(value, dict):
        return {n: _scaled(n, v, k) for n, v in value.items()}
    if isinstance(value, list):
        return [_scaled(key, v, k) if isinstance(v, (dict, list)) else v for v in value]
    if not isinstance(value, (int, float)) or isinstance(value, bool) or key in KEPT:
        return value
    if "per_sec" in key:
        return value * k
    if key.endswith(("_seconds", "_s")) or key == "seconds":
        return value / k
    return value


def cluster_figures(summary: dict, time_scale: float, run_dir: Path) -> dict:
    """summary with its durations and rates at the cluster's speed, and its `twin` section."""
    try:
        twin = json.loads((run_dir / "logs" / "twin.json").read_text())
    except (OSError, ValueError):
        twin = {}
    out = {key: _scaled(key, value, time_scale) for key, value in summary.items()} if time_scale != 1 else dict(summary)
    out["twin"] = {**twin, "time_scale": time_scale,
                   "figures": "the cluster's: durations measured in the twin divided by time_scale, rates multiplied"}
    return out


ROW_SECONDS = ("wall", "train_wall")  # metrics.jsonl's durations: seconds since the run's start


def cluster_row(row: dict, time_scale: float) -> dict:
    """A metrics.jsonl row at the cluster's speed (its `time`, the moment it was written, stays)."""
    if time_scale == 1:
        return row
    return {key: value / time_scale if key in ROW_SECONDS else _scaled(key, value, time_scale)
            for key, value in row.items()}
