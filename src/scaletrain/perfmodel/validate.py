"""The performance model against the bench: every measured row of bench outputs beside its
prediction, with the relative errors of throughput, speedup and staleness
(`scaletrain predict --validate`; `scaletrain report` shows the table)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..config import build_config
from ..errors import ProfileError
from . import scaling
from .predict import predict
from .scaling import setup
from .setup import check_workload


def validate_rows(bench_dirs: list[Path], prof, profile_path: str) -> list[dict[str, Any]]:
    """Every measured bench row with its prediction and relative error, and the measured and
    predicted speedups: both against scaling.BASELINE (the bench's measured baseline row, the
    model's prediction of that baseline), so they are the same quantity."""
    out = []
    for d in bench_dirs:
        path = d / "bench-rows.json"
        if not path.exists():
            raise ProfileError(f"{d}: no bench-rows.json (a `scaletrain bench` output directory)")
        for row in scaling.add_scaling(json.loads(path.read_text())):  # figured again: older outputs too
            if row.get("error") or row.get("data") not in (None, "real") or not scaling.measured(row):
                continue
            nested: dict[str, dict] = {}
            for k, v in row["config"].items():
                sec, key = k.split(".", 1)
                nested.setdefault(sec, {})[key] = v
            cfg = build_config(nested, origin=str(path))
            check_workload(cfg, prof, profile_path)
            pred = predict(cfg, prof)
            measured = row["images_per_sec"]
            out.append({**{k: row.get(k) for k in ("strategy", "nodes", "nodes_total", "gpus_per_node", "num_ps",
                                                   "ps_placement", "cell", "label")},
                        "baseline": scaling.is_baseline(cfg.flat()),
                        "measured": measured, "predicted": pred["images_per_sec"],
                        "rel_error": pred["images_per_sec"] / measured - 1, "bottleneck": pred["bottleneck"],
                        "measured_speedup": row["speedup"], "measured_speedup_stderr": row["speedup_stderr"],
                        "predicted_speedup": pred["speedup"],
                        **{f"{k}_{side}": src.get(k) for k in ("staleness_mean", "staleness_p95", "dropped_fraction")
                           for side, src in (("measured", row), ("predicted", pred))},
                        "method": pred["method"], "bench_dir": str(d)})
    return out


def validate_table(rows: list[dict[str, Any]]) -> str:
    def pair(r: dict[str, Any], key: str, fmt: str) -> str:
        m, p = r.get(f"{key}_measured"), r.get(f"{key}_predicted")
        return "-" if m is None and p is None else \
            " / ".join("-" if v is None else format(v, fmt) for v in (m, p))

    lines = ["| Setup | Measured (img/s) | Predicted (img/s) | Error | Speedup measured | Speedup predicted | "
             "Staleness mean | Staleness p95 | Dropped | Bottleneck (predicted) |", "|---" * 10 + "|"]
    for r in rows:
        measured = "-" if r.get("measured_speedup") is None else \
            f"{r['measured_speedup']:.2f} ± {r['measured_speedup_stderr']:.2f}"
        predicted = "-" if r.get("predicted_speedup") is None else f"{r['predicted_speedup']:.2f}"
        lines.append(f"| {setup(r)} | {r['measured']:.1f} | {r['predicted']:.1f} | {r['rel_error']:+.1%} | "
                     f"{measured} | {predicted} | {pair(r, 'staleness_mean', '.2f')} | "
                     f"{pair(r, 'staleness_p95', '.0f')} | {pair(r, 'dropped_fraction', '.1%')} | {r['bottleneck']} |")
    return "\n".join(lines)


def staleness_errors(rows: list[dict[str, Any]]) -> list[float]:
    """Relative error of the predicted mean staleness, over the rows where gradients were stale."""
    return [r["staleness_mean_predicted"] / r["staleness_mean_measured"] - 1 for r in rows
            if r.get("staleness_mean_measured") and r.get("staleness_mean_predicted") is not None]


def speedup_errors(rows: list[dict[str, Any]]) -> list[float]:
    """Relative error of the predicted speedup over the rows other than the baselines (1 on both
    sides by definition). Each speedup is over the baseline of its own bench, measured in the same
    sweep: unlike throughput, it does not follow a host that runs slower or faster than it did
    when the profile was calibrated."""
    return [r["predicted_speedup"] / r["measured_speedup"] - 1 for r in rows
            if not r.get("baseline") and r.get("measured_speedup") and r.get("predicted_speedup") is not None]
