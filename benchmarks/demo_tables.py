"""The documentation's demo page (docs/demo.md) from the outputs of `make demo`.

Reads runs/demo/bench/bench.md and runs/demo/study/study.md (the tables `make demo`
prints), the rows beside them (bench.jsonl, study.jsonl: the commit, host, device and
torch of every run) and two of runs/demo/report's plots, and writes the page with the
tables as they are, the commit the demo ran at, and whether the code it ran (src/,
recipes/, the Makefile's demo lines) is that commit's: the working tree is compared
with the commit, so a demo run on uncommitted changes, or a page written after the
code moved on, says so. The date is the demo's (its rows' files), not the page's:
run twice on the same outputs, it writes the same bytes.

    python benchmarks/demo_tables.py [--demo runs/demo] [--out docs/demo.md]     # make demo-docs

Standard library only: it needs no .venv.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The report's plots the page shows: (file in DEMO/report, name beside the page, caption).
PLOTS = [("speedup.png", "demo-speedup.png", "Speedup against nodes (bench, emulated GPUs)"),
         ("study-accuracy-nodes.png", "demo-accuracy-nodes.png", "Final test accuracy against nodes (learning study)")]
CODE = ["src", "recipes"]  # what the demo runs, beside the Makefile's demo lines


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout


def demo_lines(makefile: str) -> list[str]:
    """The Makefile's logical lines that say what `make demo` runs: its DEMO variables and its recipe."""
    logical = re.sub(r"\\\n\s*", " ", makefile).splitlines()  # continuation lines joined
    lines, in_demo = [], False
    for line in logical:
        if line.startswith("demo:"):
            in_demo = True
        elif in_demo and not line.startswith("\t"):
            in_demo = False
        if in_demo or re.match(r"DEMO\w*\s*:=", line):
            lines.append(line)
    return lines


def same_code(a: str, b: str) -> bool:
    """Whether two commits hold the same src/, recipes/ and Makefile demo lines."""
    return subprocess.run(["git", "diff", "--quiet", a, b, "--", *CODE], cwd=ROOT).returncode == 0 and \
        demo_lines(git("show", f"{a}:Makefile")) == demo_lines(git("show", f"{b}:Makefile"))


def in_order(commits: list[str]) -> list[str]:
    """The commits oldest first (by committer date), those unknown here last."""
    def key(c: str):
        try:
            return int(git("show", "-s", "--format=%ct", c).strip())
        except subprocess.CalledProcessError:
            return float("inf")
    return sorted(commits, key=key)


def code_state(commits: list[str]) -> str:
    """Sentences: the commits the demo's rows name, and whether the code in this working tree (what
    the demo ran, when it ran here) is theirs."""
    short = [c[:7] for c in commits]
    for c in commits:
        try:
            git("cat-file", "-e", f"{c}^{{commit}}")
        except subprocess.CalledProcessError:
            return f"Commit {c[:7]} is not in this repository: the code the demo ran cannot be compared."
    said = ""
    if len(commits) > 1:
        if not all(same_code(commits[0], c) for c in commits[1:]):
            return (f"**The demo's rows come from commits that differ in their code** ({', '.join(short)}): "
                    "run `make demo` again.")
        said = (f"Its rows name {len(commits)} commits ({', '.join(short)}, committed while it ran), which do not "
                "differ in src/, recipes/ or the Makefile's demo target. ")
    last = commits[-1]
    changed = [p for p in git("diff", "--name-only", last, "--", *CODE).split() if p]
    changed += [p for p in git("ls-files", "--others", "--exclude-standard", "--", *CODE).split() if p]
    if demo_lines(git("show", f"{last}:Makefile")) != demo_lines((ROOT / "Makefile").read_text()):
        changed.append("Makefile (the demo target)")
    if not changed:
        return said + (f"src/, recipes/ and the Makefile's demo target in the checkout that wrote this page are "
                       f"those of {last[:7]}: the figures are that code's.")
    shown = ", ".join(changed[:8]) + (f" and {len(changed) - 8} more" if len(changed) > 8 else "")
    return said + (f"**The checkout that wrote this page differs from {last[:7]}** ({shown}): the demo ran on "
                   "uncommitted changes, or the code moved on since; run `make demo` and `make demo-docs` again.")


def table(md: Path) -> list[str]:
    """The Markdown table of a bench or study output, without its Flag column when no row is flagged."""
    rows = [line for line in md.read_text().splitlines() if line.startswith("|")]
    if not rows:
        raise SystemExit(f"demo_tables: no table in {md}")
    cells = [[c.strip() for c in r.strip().strip("|").split("|")] for r in rows]
    if cells[0][-1] == "Flag" and all(not r[-1] for r in cells[2:]):
        cells = [r[:-1] for r in cells]
    return ["| " + " | ".join(r) + " |" for r in cells]


def rows_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--demo", type=Path, default=ROOT / "runs/demo", help="what `make demo` wrote")
    ap.add_argument("--out", type=Path, default=ROOT / "docs/demo.md")
    a = ap.parse_args()
    demo = a.demo if a.demo.is_absolute() else ROOT / a.demo
    out = a.out if a.out.is_absolute() else ROOT / a.out
    needed = [demo / "bench/bench.md", demo / "bench/bench.jsonl", demo / "study/study.md",
              demo / "study/study.jsonl", *(demo / "report" / src for src, _, _ in PLOTS)]
    missing = [str(p.relative_to(ROOT) if p.is_relative_to(ROOT) else p) for p in needed if not p.exists()]
    if missing:
        print(f"demo_tables: {', '.join(missing)} missing: run `make demo` first", file=sys.stderr)
        return 1

    rows = rows_of(demo / "bench/bench.jsonl") + rows_of(demo / "study/study.jsonl")
    commits = in_order(sorted({r.get("git_commit", "unknown") for r in rows}))
    first = rows[0]
    when = max(p.stat().st_mtime for p in needed[:4])
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(when))
    state = code_state(commits)
    env = f"host `{first.get('host')}`, {first.get('device')}, torch {first.get('torch_version')}"

    for src, name, _ in PLOTS:
        shutil.copyfile(demo / "report" / src, out.parent / name)

    page = [
        "# Demo results",
        "",
        "<!-- Written by `make demo-docs` (benchmarks/demo_tables.py) from the outputs of `make demo`; "
        "edit the script, not this page. -->",
        "",
        f"Made by `make demo`{f' at commit `{commits[0]}`' if len(commits) == 1 else ''} on {date} ({env}). {state}",
        "",
        "To make them again at your commit: `make demo` (a few minutes on two cores), then `make demo-docs`.",
        "",
        "The demo is the study in miniature: scikit-learn's handwritten digits with a ResNet-8, 1, 2 and 4",
        "emulated nodes of 2 replicas, 16 images per replica, `allreduce` against `sync` and `mixed-async`",
        "(one PS alongside), with the learning rate scaled linearly with the images per update",
        "(`optim.scale_lr = \"linear\"`, `optim.reference_batch = 32`, 5 warm-up steps). Every process runs on",
        "this machine's CPU cores; the tables' terms are defined on [Studies and report](studies.md#definitions).",
        "",
        "## Throughput (bench, emulated GPUs)",
        "",
        "Each replica's forward and backward is replaced by 0.1 s of sleep (`train.emulate_compute_s`, see",
        "[emulated GPUs](studies.md#emulated-gpus)); averaging, all-reduce, PS traffic and optimizer steps are",
        "real. 3 warm-up and 12 timed steps a cell; ± is the standard error over log windows.",
        "",
        *table(demo / "bench/bench.md"),
        "",
        "## Learning (study, real compute)",
        "",
        "Each configuration trains until its test accuracy reaches 0.95 (evaluated every 10 steps), for at",
        "most 24 epochs; time to target leaves evaluations out. More nodes mean a larger global batch and",
        "fewer updates an epoch; the rows with `optim.scale_lr=none` keep the learning rate of one node, to",
        "show what the scaling rule is for. A PS sums gradients in their arrival order, so `sync` runs differ",
        "in the last bits from run to run. Time to target is read on the bench's clock: each configuration's",
        "images to the target over the images/s the bench above measured for it on emulated GPUs. This",
        "machine's own training time is beside it: its two cores run every process of a configuration, so",
        "there more nodes do not mean less time.",
        "",
        *table(demo / "study/study.md"),
        "",
        "What the table shows, from 1 to 4 nodes (written by `scaletrain study` from these rows):",
        "",
        *[line for line in (demo / "study/study.md").read_text().splitlines() if line.startswith("- ")],
        "",
        "## Plots",
        "",
        *[f"![{caption}]({name})\n" for _, name, caption in PLOTS],
        "The full report, with every plot, is `runs/demo/report/report.html`.",
        "",
    ]
    out.write_text("\n".join(page))
    print(f"wrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
