"""The study's tables: a bench's throughput, speedup and efficiency; a learning study's
accuracy, time and improvement. Flagged figures are marked (flags.py says why).

The figures' definitions (baseline, speedup, efficiency) are perfmodel/scaling.py's, shared with
the performance model's predictions. Pure functions over dicts: no torch, no files.
"""

from __future__ import annotations

from typing import Any

from ..perfmodel.scaling import baseline, measured, setup
from . import flags

MARK = "⚠"  # beside every flagged figure in a table


def throughput_text(row: dict[str, Any]) -> str:
    """'123.4 ± 1.2', and with repeats the spread across runs: '123.4 ± 1.2 (3 runs: ± 2.0)'."""
    if not measured(row):
        return "not measured"
    text = f"{row['images_per_sec']:.1f} ± {row.get('images_per_sec_stderr') or 0:.1f}"
    runs = row.get("images_per_sec_runs") or []
    if len(runs) > 1:
        text += f" ({len(runs)} runs: ± {row.get('images_per_sec_run_stderr') or 0:.1f})"
    return text


def marked(row: dict[str, Any], key: str, text: str) -> str:
    """A figure's text with MARK when the row's flag covers it (flags.add_flags)."""
    return f"{text} {MARK}" if key in (row.get("flagged") or ()) else text


def scaling_table(rows: list[dict[str, Any]]) -> str:
    """Markdown: Setup | Throughput | Speedup | Efficiency | Speedup vs own smallest | Flag (rows
    as given, with add_scaling and flags.add_flags: a flagged figure is marked (MARK) and the Flag
    column says why). Rows that are a baseline say so; rows the bench added only to be one say
    that too."""
    is_base = {id(b) for r in rows if not r.get("error") for b in [baseline(r, rows)] if b is not None}
    lines = ["| Setup | Throughput (img/s) | Speedup | Efficiency | Speedup vs own smallest | Flag |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        added = " (baseline, not in the grid)" if r.get("added_baseline") else ""
        if r.get("error"):
            lines.append(f"| {r.get('label', '?')}{added} | not run: {r['error']} | | | | |")
            continue
        name = setup(r) + (added or (" (baseline)" if id(r) in is_base else ""))
        sp = "-" if r.get("speedup") is None else \
            marked(r, "speedup", f"{r['speedup']:.2f} ± {r['speedup_stderr']:.2f}")
        eff = "-" if r.get("efficiency") is None else marked(r, "efficiency", f"{r['efficiency']:.2f}")
        own = "-" if r.get("speedup_own") is None else \
            marked(r, "speedup_own", f"{r['speedup_own']:.2f} ± {r['speedup_own_stderr']:.2f}")
        lines.append(f"| {name} | {marked(r, 'images_per_sec', throughput_text(r))} | {sp} | {eff} | {own} | "
                     f"{r.get('flag') or ''} |")
    return "\n".join(lines)


def _time(row: dict[str, Any], until) -> float | None:
    """The row's training time, or time to target: on the profile's clock where the study has one."""
    target = until and until[0] != "epochs"
    if "clock_seconds" in row:
        return row.get("clock_time_to_target") if target else row["clock_seconds"]
    return row.get("time_to_target") if target else row.get("train_seconds")


def add_improvement(rows: list[dict[str, Any]], until) -> list[dict[str, Any]]:
    """Study rows with improvement (the baseline's time, or time to target when one is set, over
    the row's; the baseline is the first row of the fewest replicas), baseline (its label), and
    flag and flagged (flags.improvement_flag)."""
    ok = [r for r in rows if not r.get("error")]
    base = min(ok, key=lambda r: r["replicas"]) if ok else None  # the first one of the fewest replicas
    if base is not None and not _time(base, until):
        base = None
    out = []
    for orig in rows:
        r = dict(orig)
        t = _time(r, until)
        r["improvement"] = (_time(base, until) / t) if base is not None and t else None
        r["baseline"] = base["label"] if base is not None else None
        r["flag"], r["flagged"] = flags.improvement_flag(r, None if base is orig else base,
                                                     bool(until and until[0] != "epochs"))
        out.append(r)
    return out


def study_table(rows: list[dict[str, Any]], until) -> str:
    """Markdown: Setup | Workers (GPUs) | Test accuracy (best) | Time (or time to target, and
    images to target) | Steps | Improvement | Noise scale | Flag, of rows with add_improvement's figures."""
    target = until and until[0] != "epochs"
    when = f"Time to {until[0]} {'>=' if until[0] == 'accuracy' else '<='} {until[1]:g}" if target \
        else "Training time"
    clock = next((r["clock"] for r in rows if r.get("clock")), None)
    if clock:
        when += f" on {clock}"
    images = " | Images to target" if target else ""
    wall = " | Training time here" if clock else ""
    lines = [f"| Setup | Workers (GPUs) | Test accuracy (best) | {when}{images}{wall} | Steps | Improvement | "
             "Noise scale (images) | Flag |",
             "|---|---|---|---|---|---|---|---|" + ("---|" if target else "") + ("---|" if clock else "")]
    for r in rows:
        if r.get("error"):
            lines.append(f"| {r['label']} | | not run: {r['error']} | |{' |' if target else ''}{' |' if clock else ''}"
                         " | | | |")
            continue
        acc = "-" if r.get("test_accuracy") is None else f"{r['test_accuracy']:.4f} ({r['best_test_accuracy']:.4f})"
        t = _time(r, until)
        imp = "-" if r.get("improvement") is None else marked(r, "improvement", f"{r['improvement']:.2f}x")
        n = (" | -" if r.get("images_to_target") is None else f" | {r['images_to_target']:,}") if target else ""
        noise = "-" if r.get("noise_scale") is None else f"{r['noise_scale']:.0f}"
        here = f" | {r['train_seconds']:.1f} s" if clock else ""
        lines.append(f"| {setup(r)} | {r['replicas']} | {acc} | "
                     f"{'not reached' if t is None else marked(r, 'time', f'{t:.1f} s')}{n}{here} | {r['steps']} | "
                     f"{imp} | {noise} | {r.get('flag') or ''} |")
    return "\n".join(lines)


def findings(rows: list[dict[str, Any]], until) -> list[str]:
    """What the study shows from its fewest to its most nodes, for each configuration but the node
    count: whether its time (to the target, where one is set) falls, on the table's clock, and its
    test accuracy; or which node counts did not reach the target. Sentences of the table's figures,
    a finding that does not hold said as plainly as one that does."""
    target = bool(until and until[0] != "epochs")
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        if not r.get("error"):
            cell = dict(r.get("cell") or {})
            cell.pop("cluster.nodes", None)
            name = cell.pop("strategy.name", r.get("strategy", ""))
            rest = ", ".join(f"{k}={v}" for k, v in sorted(cell.items()))
            groups.setdefault(f"{name} ({rest})" if rest else str(name), []).append(r)
    what = f"time to {until[0]} {until[1]:g}" if target else "training time"
    out = []
    for name, rs in groups.items():
        rs = sorted(rs, key=lambda r: r["nodes"])
        lo, hi = rs[0], rs[-1]
        if lo["nodes"] == hi["nodes"]:
            continue
        missed = [r for r in rs if _time(r, until) is None]
        if missed:
            nodes = ", ".join(str(r["nodes"]) for r in missed)
            best = ", ".join(f"{r['best_test_accuracy']:.4f}" for r in missed)
            out.append(f"{name}: {nodes} node(s) did not reach {until[0]} {until[1]:g} (best test accuracy {best})"
                       if target else f"{name}: no training time at {nodes} node(s)")
            continue
        t0, t1 = _time(lo, until), _time(hi, until)
        verb = "falls" if t1 < t0 else "does not fall"
        points = (hi["test_accuracy"] - lo["test_accuracy"]) * 100
        out.append(f"{name}: {what} {verb} from {lo['nodes']} to {hi['nodes']} nodes, {t0:.1f} s to {t1:.1f} s; "
                   f"test accuracy {lo['test_accuracy']:.4f} to {hi['test_accuracy']:.4f} ({points:+.1f} points)")
    return out

