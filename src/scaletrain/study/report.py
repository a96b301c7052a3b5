"""`scaletrain report DIR...`: the study's tables and plots as report.md and report.html.

A DIR is a bench output (bench-rows.json), a study output (study-rows.json)
or a single run (summary.json). Plots (plots.py) are PNG files beside
report.md; the HTML embeds the same PNGs, so report.html is one
self-contained file.
"""

from __future__ import annotations

import base64
import html
import json
import statistics
import sys
from pathlib import Path

from ..perfmodel import scaling
from ..perfmodel.validate import validate_table
from . import figures, flags
from .plots import bench_plots, learning_plots, predicted_plot, staleness_plot


def _load(dirs: list[Path]) -> tuple[list[dict], list[dict], list[dict], list[dict]]:
    bench_rows, study_rows, runs, predicted = [], [], [], []
    def rows_of(path: Path) -> list[dict]:  # run directories are kept relative to the rows' folder
        rows = json.loads(path.read_text())
        for r in rows:
            if r.get("run_dir"):
                r["run_dir"] = str(path.parent / r["run_dir"])
        return rows

    for d in dirs:
        if (d / "validate-rows.json").exists():  # `scaletrain predict --validate` against this bench
            predicted += json.loads((d / "validate-rows.json").read_text())["rows"]
        if (d / "bench-rows.json").exists():  # figured again, so older outputs read as today's definitions
            bench_rows += flags.add_flags(scaling.add_scaling(rows_of(d / "bench-rows.json")))
        elif (d / "study-rows.json").exists():
            rows = rows_of(d / "study-rows.json")
            until = tuple(rows[0]["until"]) if rows and rows[0].get("until") else None
            study_rows += figures.add_improvement(rows, until)
        elif (d / "summary.json").exists():
            s = json.loads((d / "summary.json").read_text())
            runs.append({**s, "label": d.name, "run_dir": str(d)})
        elif not (d / "validate-rows.json").exists():
            raise FileNotFoundError(f"{d}: neither a bench, a study nor a run directory "
                                    "(no bench-rows.json, study-rows.json, summary.json or validate-rows.json)")
    return bench_rows, study_rows, runs, predicted


def _summaries(rows: list[dict], source: str) -> list[dict]:
    out = []
    for r in rows:
        p = Path(r.get("run_dir", "")) / "summary.json"
        if not r.get("error") and p.exists():
            out.append({**json.loads(p.read_text()), "label": r.get("label"), "cell": r.get("cell", {}),
                        "source": source})
    return out


def write_report(dirs: list[Path], out: Path) -> Path:
    """Write OUT/report.md, OUT/report.html and the PNGs; returns the HTML's path."""
    bench_rows, study_rows, runs, predicted = _load([Path(d) for d in dirs])
    out.mkdir(parents=True, exist_ok=True)
    made: list[tuple[str, str]] = []
    sections = []
    if bench_rows:
        sections.append(("Throughput, speedup and efficiency", figures.scaling_table(bench_rows), DEFINITIONS))
        bench_plots(bench_rows, out, made)
    if study_rows:
        until = study_rows[0].get("until")
        until = tuple(until) if until else None
        sections.append(("Learning: accuracy and time", figures.study_table(study_rows, until), STUDY_DEFINITIONS,
                         figures.findings(study_rows, until)))
        learning_plots(study_rows, out, made, "study-", until)
    if runs:
        lines = ["| Run | Strategy | Replicas | Steps | img/s | Test accuracy | Flag |",
                 "|---|---|---|---|---|---|---|"]
        for r in runs:
            doubts = flags.rate_doubts(r)
            lines.append(f"| {r['label']} | {r.get('strategy', '-')} | {r.get('replicas', 1)} | {r['steps']} | "
                         f"{figures.throughput_text(r)}{f' {figures.MARK}' if doubts else ''} | "
                         f"{r.get('test_accuracy') or '-'} | {', '.join(doubts)} |")
        sections.append(("Runs", "\n".join(lines), ""))
        learning_plots(runs, out, made, "runs-")
    if predicted:
        err = statistics.median(abs(r["rel_error"]) for r in predicted)
        sections.append(("Predicted against measured", validate_table(predicted),
                         f"Performance model (scaletrain predict --validate): median absolute error {err:.1%} "
                         f"over {len(predicted)} configurations."))
        predicted_plot(predicted, out, made)
    summaries = _summaries(bench_rows, "bench") + _summaries(study_rows, "study") + \
        [{**r, "source": "run"} for r in runs]
    staleness_plot(summaries, out, made)
    staleness_plot(summaries, out, made, "gradients_per_update_hist")
    md = ["# scaletrain report", ""]
    for title, table, notes, *found in sections:
        md += [f"## {title}", "", table, ""] + ([f"- {line}" for line in found[0]] + [""] if found and found[0] else [])
        md += [notes, ""] if notes else []
    md += ["## Plots", ""] + [f"![{t}]({name})" for name, t in made] + [""]
    (out / "report.md").write_text("\n".join(md))
    (out / "report.html").write_text(_html(sections, made, out))
    return out / "report.html"


FLAGS = (f"{figures.MARK}: a figure that cannot be taken as the job's, the Flag column says why: a throughput "
         f"whose standard error passes {flags.SPREAD:.0%} of it (unsteady), one with a log window under "
         f"{flags.STALL:.0%} of the median window's rate (stalled), a figure built on either, and one past its "
         "bound (efficiency 1; speedup, and an improvement with no target, the replicas' ratio) by more than "
         f"{flags.Z:g} standard errors.")
DEFINITIONS = ("Throughput: images per second over all replicas, the first --warmup steps left out, ± the "
               "standard error over log windows (with repeats: the mean over runs, and in brackets the standard "
               "error across runs). Speedup (the study's): throughput over that of one node with no "
               "distribution, the baseline row: the same replicas per node averaged by all-reduce, no PS, every "
               "other key the same; a PS strategy on one node is measured against it too. Efficiency: speedup "
               "over the nodes used, dedicated PS nodes included. Speedup vs own smallest: throughput over that "
               "of the same strategy's configuration with the fewest nodes. " + FLAGS)
STUDY_DEFINITIONS = ("Workers (GPUs): replicas. Test accuracy: at the end (best during the run). Time: training "
                     "time (evaluations left out), or that until the target was first reached. Improvement: the "
                     "baseline's time (the first configuration with the fewest replicas) over this one's. " + FLAGS)


def _md_table_html(table: str) -> str:
    """The markdown table as HTML; a flagged figure and its reason (the Flag column) are highlighted."""
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in table.splitlines()
            if not set(line.replace("|", "").strip()) <= {"-"}]
    head, body = rows[0], rows[1:]

    def td(c: str, col: str) -> str:
        flagged = c and (figures.MARK in c or col == "Flag")
        return f"<td class='flag'>{html.escape(c)}</td>" if flagged else f"<td>{html.escape(c)}</td>"

    return ("<table><thead><tr>" + "".join(f"<th>{html.escape(c)}</th>" for c in head) + "</tr></thead><tbody>"
            + "".join("<tr>" + "".join(td(c, col) for c, col in zip(r, head)) + "</tr>" for r in body)
            + "</tbody></table>")


def _html(sections, made, out: Path) -> str:
    parts = ["<!doctype html><html lang='en'><head><meta charset='utf-8'><title>scaletrain report</title>",
             "<style>body{font-family:sans-serif;max-width:980px;margin:2em auto;color:#222}"
             "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #bbb;padding:4px 8px;"
             "text-align:right}td:first-child,th:first-child{text-align:left}th{background:#eee}"
             "figure{margin:16px 0}img{max-width:100%}td.flag{background:#fde2dc;color:#8a1c0c;text-align:left}"
             "</style></head><body>",  # small multiples: full width
             "<h1>scaletrain report</h1>"]
    for title, table, notes, *found in sections:
        parts += [f"<h2>{html.escape(title)}</h2>", _md_table_html(table)]
        if found and found[0]:
            parts.append("<ul>" + "".join(f"<li>{html.escape(line)}</li>" for line in found[0]) + "</ul>")
        if notes:
            parts.append(f"<p>{html.escape(notes)}</p>")
    if made:
        parts.append("<h2>Plots</h2>")
    for name, title in made:
        data = base64.b64encode((out / name).read_bytes()).decode()
        parts.append(f"<figure><img src='data:image/png;base64,{data}' alt='{html.escape(title)}'>"
                     f"<figcaption>{html.escape(title)}</figcaption></figure>")
    parts.append("</body></html>")
    return "\n".join(parts)


def main(args) -> int:
    out = args.out or Path(args.dirs[0]) / "report"
    try:
        path = write_report(args.dirs, out)
    except FileNotFoundError as e:
        print(f"scaletrain: error: {e}", file=sys.stderr)
        return 2
    print(f"report: {path}")
    return 0
