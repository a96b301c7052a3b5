"""Flags on result rows: figures that cannot be true of the job, each with its reason in words.

A throughput measured while another process took the host is not the job's, and neither is
a figure built on it: a baseline slowed to a fraction of its rate puts every configuration
measured against it above its bound (an efficiency above 1). A row's `flag` says which
figures are in doubt and why ("efficiency 3.43 ± 1.71 > 1: baseline unsteady (±50%); rerun
with --repeats 3"), and `flagged` names them, so that tables, JSON and
the report never publish such a figure plain. A figure derived from a flagged throughput is
flagged with it: speedup and efficiency from their baseline's, a study's improvement from
its first configuration's. The bounds and their reasons are here and nowhere else.

Pure functions over dicts: no torch, no files.
"""

from __future__ import annotations

import math
from typing import Any

from ..perfmodel import scaling

# A throughput whose relative standard error passes this is unsteady: quiet cells of a bench
# stay within a few percent, and at ±10% the gaps between strategies (often 10-20%) are lost.
SPREAD = 0.10
# A log window slower than this fraction of the run's median window is a stall: the job stood
# still for most of it (another process took the host, swapping), which no strategy explains.
STALL = 0.25
# A figure is past its bound beyond its uncertainty when it passes it by more than Z standard
# errors (one-sided, about 2% of honest figures would): 1.03 ± 0.05 is an efficiency of 1, 1.40 ± 0.05 is not.
Z = 2.0


def rate_doubts(row: dict[str, Any]) -> list[str]:
    """Why a measured throughput is not the job's, in a few words each; [] when nothing is doubted."""
    if not scaling.measured(row):
        return []
    out = []
    rel = scaling.throughput_se(row) / row["images_per_sec"] if row["images_per_sec"] else 0.0
    if rel > SPREAD:
        out.append(f"unsteady (±{rel:.0%})")
    slowest = row.get("slowest_window_fraction")
    if slowest is not None and slowest < STALL:
        out.append(f"stalled (a log window at {slowest:.0%} of the median rate)")
    return out


def repeats_advice(*rows: dict[str, Any] | None) -> str:
    """What to run again: twice the repeats the rows had, at least 3 (repeats run the grid pass
    after pass, so a slow spell of the host falls on every cell rather than on one)."""
    runs = max(len(r.get("images_per_sec_runs") or []) or 1 for r in rows if r is not None)
    return f"rerun with --repeats {max(3, 2 * runs)}"


def _replicas(row: dict[str, Any]) -> int:
    return row.get("replicas") or row["nodes"] * (row.get("gpus_per_node") or 1)


def _compose(over: list[str], causes: list[str], advice: str) -> str:
    causes = list(dict.fromkeys(causes))
    text = ", ".join(over) + (": " if over and causes else "") + ", ".join(causes)
    return f"{text}; {advice}"


def scaling_flag(row: dict[str, Any], base: dict[str, Any] | None,
                 own: dict[str, Any] | None) -> tuple[str | None, list[str]]:
    """A bench row's flag and flagged figures (row with add_scaling's figures; base and own its
    baseline and own smallest rows, or None). A figure above its bound (efficiency above 1,
    speedup above the replicas' ratio) is flagged when its inputs are in doubt, or on its own
    when it passes the bound beyond its uncertainty."""
    if not scaling.measured(row):
        return "not measured: no log window after the warm-up; raise --steps", ["images_per_sec"]
    mine = rate_doubts(row)
    over, causes, flagged = [], list(mine), ["images_per_sec"] if mine else []
    for other, who, keys in ((base, "baseline", ("speedup", "efficiency")),
                             (own, "own smallest", ("speedup_own",))):
        if other is None or other is row or row.get(keys[0]) is None:
            continue
        if who == "own smallest" and other is base:  # the same figure as the speedup: flagged alike, said once
            flagged += keys if "speedup" in flagged else []
            continue
        theirs = [f"{who} {d}" for d in rate_doubts(other)]
        value, se, bound = row[keys[0]], row[keys[0] + "_stderr"] or 0.0, _replicas(row) / _replicas(other)
        name = "speedup" if who == "baseline" else "speedup vs own smallest"
        if who == "baseline" and row["efficiency"] > 1:  # the figure a reader checks against 1
            name, value, se, bound = "efficiency", row["efficiency"], se / row["nodes_total"], 1
        beyond = value - Z * se > bound
        if mine or theirs or beyond:
            flagged += keys
            causes += theirs
            if value > bound:
                over.append(f"{name} {value:.2f} ± {se:.2f} > {bound:g}" +
                            ("" if name == "efficiency" else " (the replicas' ratio)"))
    if not flagged:
        return None, []
    return _compose(over, causes, repeats_advice(row, base, own)), list(dict.fromkeys(flagged))


def add_flags(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Bench rows (with add_scaling's figures) with `flag` (None when nothing is in doubt) and
    `flagged` (which of images_per_sec, speedup, efficiency, speedup_own it covers)."""
    out = []
    for orig in rows:
        row = dict(orig)
        row["flag"], row["flagged"] = (None, []) if row.get("error") else \
            scaling_flag(orig, scaling.baseline(orig, rows), scaling.own_smallest(orig, rows))
        out.append(row)
    return out


def improvement_flag(row: dict[str, Any], base: dict[str, Any] | None, target: bool) \
        -> tuple[str | None, list[str]]:
    """A study row's flag and flagged figures (time, improvement; base None for the baseline
    itself, whose improvement is 1 by definition): its time is in doubt with its
    throughput, its improvement with either throughput. With no target, the same work per image
    bounds the improvement by the replicas' ratio times the ratio of images trained (the epochs),
    which it passes only beyond its uncertainty when a time is not the job's; the time to a
    target has no such bound (a larger batch may need fewer images)."""
    advice = "rerun the study on a quiet host"
    if row.get("error"):
        return None, []
    mine = rate_doubts(row)
    flagged = ["time"] if mine else []
    imp = row.get("improvement")
    if imp is None or base is None:
        return (_compose([], mine, advice), flagged) if mine else (None, [])
    theirs = [f"baseline {d}" for d in rate_doubts(base)]
    bound, why = _replicas(row) / _replicas(base), "the replicas' ratio"
    if not target and row.get("epochs") and base.get("epochs") and row["epochs"] != base["epochs"]:
        bound, why = bound * base["epochs"] / row["epochs"], "the replicas' ratio over the epochs' ratio"
    rel = [scaling.throughput_se(r) / r["images_per_sec"] if scaling.measured(r) and r["images_per_sec"] else 0.0
           for r in (row, base)]
    beyond = not target and imp - Z * imp * math.hypot(*rel) > bound
    over = [f"improvement {imp:.2f}x > {bound:.3g}x ({why})"] if imp > bound else []
    if not (mine or theirs or beyond):
        return None, []
    return _compose(over, mine + theirs, advice), [*flagged, "improvement"]
