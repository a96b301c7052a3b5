"""ResNet-50's gradient in the cluster twin, beside the performance model's prediction.

Each row is a real `scaletrain bench` cell with `cluster.network = netns` (root): one network
namespace per emulated node, links shaped to the row's rate each way (docs/twin.md). Every
replica emulates one K80 die of the study (train.emulate_compute_s = the study profile's
compute_s, 1.0018 s for 32 images: profiles/study-k80.toml) and moves ResNet-50's real gradient:
model.name = resnet50 with model.num_classes = 1200, the study's, is 25,966,832 parameters,
the profile's gradient_bytes to the byte; the digits recipe supplies the rest (no image is read
by an emulated replica, so data.image_size only has to let the network build). One replica a
node (cluster.gpus_per_node = 1), data.workers = 0. Rows: 2, 4 and 8 nodes x sync (1 PS
alongside), mixed-async (1 PS alongside) and allreduce, at 1 and 10 Gbit/s a link.

Time scale. Two shared cores carry every emulated link's bytes through the kernel. The script first
asks `scaletrain twin test` which rates one link delivers here (within 10% of the set rate, the
twin's own tolerance, in the median of three tests: other users of the machine come and go) and takes
the largest, C (or --capacity-gbps C), as what the machine may carry at once (times
--headroom, default 1; less leaves cores to the job's own copies and optimizer and to other users of
the machine). A row loads it with about nodes x rate for a ring (every node sends at the link
rate at once) and 2 x rate for a parameter server (its node's link, both ways), and at least
nodes / 2 x rate (the row's self-test sends over every pair of nodes at once); the row's
cluster.time_scale k is the smallest of 1, 2, 5, 10, 20, 50, 100 that brings load / k within it and,
second bound, brings the host's own work within HOST_SHARE (4%) of the predicted step: the twin
dilates emulated compute and links by k but not the CPU work a replica does on the host (the
gradient's fill, the optimizer's step, gloo's sums and copies: about HOST_CPU_S = 0.17 CPU-seconds
per process per step for ResNet-50's gradient, read from the all-reduce rows of
twin-2026-11-27T0936Z-1f0ee92.json, the same at k = 1 to 10 and 1 and 10 Gbit/s), which a GPU
cluster does inside compute_s. Its share of the cluster's step is processes x HOST_CPU_S / cores / k
over the step; each row reports the host time it implies, host_cpu_s_implied.
A row whose own link self-test still refuses the twin runs again at the next k (twice at most).
The summary's figures are the cluster's (durations / k, rates x k), as bench reads them.

Prediction. `scaletrain predict` with the study profile whose net_bandwidth is the payload a link of
the row's rate carries (rate x 1e9 / 8 bytes/s x twin.selftest.FRAMING, 1448 of every 1514 bytes a
frame: TCP with timestamps in a 1500-byte MTU, and the Ethernet header, which tbf counts; a copy in
a temporary directory) and the study's recipe
(recipes/anp-resnet50.toml) at one GPU a node. A second figure, `predicted_network_only`, leaves
the PS's CPU out (ps_apply_rate and ps_accumulate_rate 1e15) and makes its shard send its own
replies (ps_overlap = false, scaletrain's server): the twin dilates neither the PS's CPU time nor
anything but emulated compute and links, so at k > 1 its PS computes k times faster than the
cluster's, and that figure is the model of what the twin emulates. Each prediction carries
predict's `band` (perfmodel/bands.py), and --predict-again reports `coverage`: the fraction of
rows whose measured images/s lie inside the band. The study profile is set from published
figures, with no calibration spread, so its bands are null and coverage is null with that reason.

comm_share: the summary's time_split_s, comm_s / (compute_s + intra_s + comm_s), the workers'
mean (all-reduce between nodes, or pushes and pulls waiting on the PS); predicted: the step's
network part (ring) or the time beyond compute it waits on the PS (simulated), over the step.

Findings, computed from the rows: where sync's PS saturates (the first node count whose
efficiency is under 2/3 of the previous count's: doubling the nodes added under a third of
throughput), where all-reduce wins (per rate, the fewest nodes at which allreduce's images/s
exceed sync's by more than two standard errors), and what asynchrony buys on the slowest link
(mixed-async / sync images/s per node count).

    python benchmarks/twin.py [--quick] [--save] [--warmup 2 --steps 8 --capacity-gbps C --headroom 1]
                              [--nodes 2 4 8 --rates 1 10 --strategies sync mixed-async allreduce]
                              [--repeats R --time-scale K]
    python benchmarks/twin.py --predict-again benchmarks/results/twin-....json [--save]

--quick: 2 and 4 nodes at 1 Gbit/s, 1 + 4 steps (a few minutes). The full run takes about 75 minutes
on two cores. Progress on stderr, one JSON on stdout; --save also writes it to
benchmarks/results/twin-<UTC time>-<short commit>.json. Run directories stay under /tmp
(weights and checkpoints removed); their path is in the JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = "recipes/digits.toml"
PREDICT_RECIPE = "recipes/anp-resnet50.toml"
PROFILE = "profiles/study-k80.toml"
MODEL = ["model.name=resnet50", "model.num_classes=1200", "data.image_size=32"]
STRATEGIES = (("sync", 1), ("mixed-async", 1), ("allreduce", 0))  # (strategy.name, cluster.num_ps)
SERIES = (1, 2, 5, 10, 20, 50, 100)  # time scales tried, smallest first
TESTED_GBPS = (1, 2, 3, 4, 6, 8, 12, 16)
TOLERANCE = 0.9  # as the twin's self-test
HOST_CPU_S = 0.17  # CPU-seconds of host work per process per step (see the docstring)
HOST_SHARE = 0.04  # the most of the predicted step that host work, / k, may take
RETRIES = 2


def say(msg: str) -> None:
    print(f"twin bench: {msg}", file=sys.stderr, flush=True)


def scaletrain(*args: str, capture: bool = True) -> subprocess.CompletedProcess:
    """The CLI, from this checkout's environment; its progress goes to stderr when not captured."""
    out = subprocess.PIPE if capture else sys.stderr
    return subprocess.run([sys.executable, "-m", "scaletrain", *args], cwd=ROOT, text=True, stdout=out,
                          stderr=subprocess.PIPE if capture else None)


def capacity(seconds: float = 1.0, tries: int = 3) -> dict:
    """`scaletrain twin test` at rising rates until one link delivers under TOLERANCE of its rate
    in the median of `tries` tests (neither a busy moment of a shared machine nor a lucky second is
    its capacity): the largest rate that passed is what this machine carries (C)."""
    tests = []
    for g in TESTED_GBPS:
        got = [twin_test(g, seconds) for _ in range(tries)]
        typical = statistics.median(got)
        tests.append({"set_gbps": g, "measured_gbps": [round(x, 3) for x in got], "ratio": round(typical / g, 3)})
        say(f"twin test at {g} Gbit/s: {', '.join(f'{x:.3g}' for x in got)} delivered")
        if typical < TOLERANCE * g:
            break
    passed = [t["set_gbps"] for t in tests if t["ratio"] >= TOLERANCE]
    if not passed:
        sys.exit(f"twin bench: the twin carries under {TOLERANCE:.0%} of {TESTED_GBPS[0]} Gbit/s here")
    return {"tests": tests, "gbps": max(passed)}


def twin_test(gbps: float, seconds: float) -> float:
    r = scaletrain("twin", "test", "--gbps", str(gbps), "--seconds", str(seconds))
    if r.returncode:
        sys.exit(f"twin bench: `scaletrain twin test --gbps {gbps}` failed: {(r.stderr or r.stdout).strip()[-300:]}")
    return json.loads(r.stdout)["measured_gbps"]


def load_gbps(nodes: int, num_ps: int, rate: float) -> tuple[float, str]:
    """Gbit/s the machine carries at once at the cluster's rate, and why: a ring moves every node's
    link at once; a parameter server's traffic crosses its node's link, both ways; and the row's
    own link self-test first sends over every pair of nodes at once (nodes / 2 links' worth)."""
    job = (nodes * rate, "nodes x rate, the ring") if num_ps == 0 else (2 * rate, "2 x rate, the PS's link")
    test = (math.ceil(nodes / 2) * rate, "nodes / 2 x rate, the self-test's pairs")
    return test if test[0] > job[0] else job


def host_s(r: dict) -> float:
    """Wall seconds of a row's host work per step at k = 1: its processes' CPU time over the cores."""
    return (r["nodes"] + r["num_ps"]) * HOST_CPU_S / (os.cpu_count() or 1)


def time_scale(load: float, budget: float, host: float = 0.0, step: float = math.inf) -> int:
    return next((k for k in SERIES if load / k <= budget and host / k <= HOST_SHARE * step), SERIES[-1])


def plan(nodes: list[int], rates: list[float], budget: float, tmp: Path, strategies: list[str] | None = None,
         scale: int = 0) -> list[dict]:
    """The rows, each with its time scale (`scale` when given, else the smallest within the bounds)."""
    rows = []
    for rate in rates:
        for n in nodes:
            for name, ps in STRATEGIES:
                if strategies and name not in strategies:
                    continue
                load, why = load_gbps(n, ps, rate)
                rows.append({"nodes": n, "strategy": name, "num_ps": ps, "link_gbps": rate, "load_gbps": load,
                             "load": why})
    add_predictions(rows, tmp)
    for r in rows:
        step = (r["predicted_network_only"] or {}).get("step_s") or math.inf
        r["time_scale"] = scale or time_scale(r["load_gbps"], budget, host_s(r), step)
    return rows


def host_implied(r: dict, batch: int) -> float | None:
    """The CPU-seconds of host work per process per step that the row's gap to the network-only
    prediction implies (as HOST_CPU_S was read), or None without both figures."""
    got, want = r.get("images_per_sec"), (r.get("predicted_network_only") or {}).get("images_per_sec")
    if not got or not want:
        return None
    gap = r["nodes"] * batch * (1 / got - 1 / want)  # seconds per step of the cluster
    return gap * r["time_scale"] * (os.cpu_count() or 1) / (r["nodes"] + r["num_ps"])


def bench_args(rate: float, k: int, rows: list[dict], compute_s: float, batch: int, warmup: int, steps: int,
               out: Path, repeats: int = 1) -> list[str]:
    cells = ",".join(f"{r['nodes']}:{r['strategy']}:{r['num_ps']}" for r in rows)
    sets = [*MODEL, f"data.batch_size={batch}", f"train.emulate_compute_s={compute_s}", "data.workers=0",
            "cluster.gpus_per_node=1", "cluster.network=netns", f"cluster.link_gbps={rate:g}",
            f"cluster.time_scale={k}"]
    return ["bench", "--recipe", RECIPE, *(a for s in sets for a in ("--set", s)),
            "--grid", f"cluster.nodes+strategy.name+cluster.num_ps={cells}",
            "--warmup", str(warmup), "--steps", str(steps), "--out", str(out),
            *(["--repeats", str(repeats)] if repeats > 1 else [])]


def run_group(rate: float, k: int, rows: list[dict], a, study: dict, runs: Path) -> tuple[list[dict], dict]:
    """One `scaletrain bench` of rows sharing a rate and time scale: the rows measured (or with
    their error) and the group's added 1-node baseline."""
    out = runs / f"rate{rate:g}-k{k}"
    args = bench_args(rate, k, rows, study["compute_s"], study["batch"], a.warmup, a.steps, out, a.repeats)
    say(f"{rate:g} Gbit/s, time scale {k}: " + "; ".join(f"{r['nodes']} nodes {r['strategy']}" for r in rows))
    t0 = time.monotonic()
    scaletrain(*args, capture=False)  # a failed cell is a row with its error
    say(f"  done in {time.monotonic() - t0:.0f} s")
    got = json.loads((out / "bench-rows.json").read_text()) if (out / "bench-rows.json").exists() else []
    base = next((b for b in got if b.get("added_baseline")), {})
    measured = []
    for r in rows:
        b = next((b for b in got if not b.get("added_baseline") and b["cell"] == cell(r)), None)
        measured.append(row_figures(r, k, b, out, "scaletrain " + " ".join(args)))
    prune(out)
    return measured, {"link_gbps": rate, "time_scale": k, "images_per_sec": base.get("images_per_sec"),
                      "images_per_sec_stderr": base.get("images_per_sec_stderr"), "error": base.get("error"),
                      "command": "scaletrain " + " ".join(args)}


def cell(r: dict) -> dict:
    return {"cluster.nodes": str(r["nodes"]), "strategy.name": r["strategy"], "cluster.num_ps": str(r["num_ps"])}


def row_figures(r: dict, k: int, b: dict | None, out: Path, command: str) -> dict:
    """The row's figures from its bench row and its run's summary (time split, twin section)."""
    row = {**r, "time_scale": k, "twin_link_gbps": r["link_gbps"] / k, "command": command}
    if b is None or b.get("error"):
        return {**row, "error": (b or {}).get("error", "no bench row")}
    summary = json.loads((out / b["run_dir"] / "summary.json").read_text())
    split = summary.get("time_split_s") or {}
    total = sum(split.values())
    test = (summary.get("twin") or {}).get("self_test") or {}
    row.update({key: b.get(key) for key in ("images_per_sec", "images_per_sec_stderr", "speedup", "speedup_stderr",
                                            "efficiency", "staleness_mean", "timed_windows", "flag", "wall_seconds")})
    row.update({key: b[key] for key in ("images_per_sec_runs", "images_per_sec_run_stderr") if key in b})  # --repeats
    row.update(comm_share=split.get("comm_s", 0.0) / total if total else None, time_split_s=split,
               self_test={"set_gbps": test.get("set_gbps"), "measured_gbps": test.get("measured_gbps"),
                          "worst_ratio": test.get("ratio")},
               run_dir=str(out / b["run_dir"]))
    return row


def prune(out: Path) -> None:
    """The weights and checkpoints of every cell (300 MB each, not needed for the figures)."""
    for path in out.glob("cells/*/model.safetensors"):
        path.unlink()
    for path in out.glob("cells/*/checkpoints"):
        shutil.rmtree(path, ignore_errors=True)


def refused(row: dict) -> bool:
    """A row the twin's self-test refused: its links ran below the set rate (the CPUs limited)."""
    return "time_scale" in (row.get("error") or "")


def measure(rows: list[dict], a, study: dict, runs: Path) -> tuple[list[dict], list[dict]]:
    """Every row, grouped by (rate, time scale); refused rows again at the next scale."""
    done, baselines, todo = [], [], rows
    for attempt in range(RETRIES + 1):
        groups: dict[tuple, list[dict]] = {}
        for r in todo:
            groups.setdefault((r["link_gbps"], r["time_scale"]), []).append(r)
        again = []
        for (rate, k), group in sorted(groups.items()):
            got, base = run_group(rate, k, group, a, study, runs)
            baselines.append(base)
            higher = next((s for s in SERIES if s > k), None)
            for g in got:
                if refused(g) and attempt < RETRIES and higher:
                    say(f"  {g['nodes']} nodes {g['strategy']}: refused at time scale {k} ({g['error']}); "
                        f"again at {higher}")
                    again.append({**g, "time_scale": higher, "refused_at": [*g.get("refused_at", []), k]})
                else:
                    done.append(g)
        todo = [{key: v for key, v in g.items() if key not in ("error", "command", "twin_link_gbps")} for g in again]
        if not todo:
            break
    return done, baselines


def predict(rows: list[dict], rate: float, network_only: bool, tmp: Path) -> list[dict]:
    """`scaletrain predict` of rows at one link rate: the study profile with net_bandwidth at it."""
    from scaletrain.perfmodel.profile import dump_profile, load_profile
    from scaletrain.twin.selftest import FRAMING

    prof, about = load_profile(ROOT / PROFILE)
    prof = replace(prof, net_bandwidth=rate * 1e9 / 8 * FRAMING)  # the payload a link of that rate carries
    if network_only:
        prof = replace(prof, ps_apply_rate=1e15, ps_accumulate_rate=1e15, ps_overlap=False)
    path = tmp / f"study-k80-{rate:g}gbps{'-network' if network_only else ''}.toml"
    path.write_text(dump_profile(prof, about))
    cells = ",".join(sorted({f"{r['nodes']}:{r['strategy']}:{r['num_ps']}" for r in rows}))
    r = scaletrain("predict", "--profile", str(path), "--recipe", PREDICT_RECIPE, "--set", "cluster.gpus_per_node=1",
                   "--grid", f"cluster.nodes+strategy.name+cluster.num_ps={cells}", "--format", "json")
    if not r.stdout.strip():
        sys.exit(f"twin bench: predict failed: {r.stderr.strip()[-300:]}")
    return json.loads(r.stdout)


def predicted(p: dict | None) -> dict | None:
    if p is None or p.get("error"):
        return {"error": (p or {}).get("error", "no prediction")}
    parts = p.get("parts_s") or {}
    comm = parts.get("communication", parts.get("network", 0.0))  # the PS's wait (simulated), or the ring
    return {"images_per_sec": p["images_per_sec"], "speedup": p["speedup"], "efficiency": p["efficiency"],
            "step_s": p["step_s"], "comm_share": comm / p["step_s"],
            "bottleneck": p["bottleneck"], "staleness_mean": p["staleness_mean"], "band": p.get("band")}


def add_predictions(rows: list[dict], tmp: Path) -> None:
    for rate in sorted({r["link_gbps"] for r in rows}):
        at = [r for r in rows if r["link_gbps"] == rate]
        for key, network_only in (("predicted", False), ("predicted_network_only", True)):
            got = predict(at, rate, network_only, tmp)
            for r in at:
                p = next((p for p in got if p["cell"] == cell(r)), None)
                r[key] = predicted(p)
        for r in at:
            if r.get("images_per_sec") and (r["predicted"] or {}).get("images_per_sec"):
                r["measured_over_predicted"] = r["images_per_sec"] / r["predicted"]["images_per_sec"]


def ratio(a: float, a_se: float, b: float, b_se: float) -> tuple[float, float]:
    r = a / b
    return r, abs(r) * math.hypot(a_se / a if a else 0.0, b_se / b if b else 0.0)


def figure(r: dict | None, source: str, key: str = "images_per_sec"):
    """A row's measured figure (source 'measured') or its prediction's; None where there is none."""
    if r is None:
        return None
    return r.get(key) if source == "measured" else (r.get("predicted") or {}).get(key)


def find(rows: list[dict], rate: float, strategy: str, nodes: int) -> dict | None:
    return next((r for r in rows if (r["link_gbps"], r["strategy"], r["nodes"]) == (rate, strategy, nodes)), None)


def ps_saturation(rows: list[dict], rate: float, source: str) -> dict:
    nodes = sorted({r["nodes"] for r in rows})
    eff = {n: figure(find(rows, rate, "sync", n), source, "efficiency") for n in nodes}
    at = next((n for prev, n in zip(nodes, nodes[1:])
               if eff[prev] and eff[n] is not None and eff[n] < 2 / 3 * eff[prev]), None)
    return {"efficiency_by_nodes": eff, "saturates_at_nodes": at}


def allreduce_wins(rows: list[dict], rate: float, source: str) -> dict:
    by = {}
    for n in sorted({r["nodes"] for r in rows}):
        ar, sy = find(rows, rate, "allreduce", n), find(rows, rate, "sync", n)
        a, s = figure(ar, source), figure(sy, source)
        if a is None or s is None:
            continue
        se = 0.0 if source != "measured" else math.hypot(ar.get("images_per_sec_stderr") or 0.0,
                                                       sy.get("images_per_sec_stderr") or 0.0)
        by[n] = {"allreduce_over_sync": a / s, "wins": a - s > 2 * se}
    return {"by_nodes": by, "smallest_nodes": next((n for n, v in by.items() if v["wins"]), None)}


def async_gain(rows: list[dict], rate: float, source: str) -> dict:
    by = {}
    for n in sorted({r["nodes"] for r in rows}):
        m, s = find(rows, rate, "mixed-async", n), find(rows, rate, "sync", n)
        if figure(m, source) is None or figure(s, source) is None:
            continue
        if source == "measured":
            x, se = ratio(m["images_per_sec"], m.get("images_per_sec_stderr") or 0.0, s["images_per_sec"],
                          s.get("images_per_sec_stderr") or 0.0)
            by[n] = {"mixed_async_over_sync": x, "stderr": se, "staleness_mean": m.get("staleness_mean")}
        else:
            by[n] = {"mixed_async_over_sync": figure(m, source) / figure(s, source),
                     "staleness_mean": figure(m, source, "staleness_mean")}
    return by


def fidelity(rows: list[dict]) -> dict:
    """The measured images/s against the network-only prediction (what the twin emulates): the median
    and largest |measured / predicted - 1| over the rows that have both."""
    errs = [abs(r["images_per_sec"] / q - 1) for r in rows
            if r.get("images_per_sec") and (q := (r.get("predicted_network_only") or {}).get("images_per_sec"))]
    return {"against": "predicted_network_only", "rows": len(errs),
            "median_abs_error": statistics.median(errs) if errs else None, "max_abs_error": max(errs, default=None)}


def findings(rows: list[dict]) -> dict:
    rates = sorted({r["link_gbps"] for r in rows})
    return {
        "ps_saturation": {"criterion": "sync: the first node count whose efficiency is under 2/3 of the previous "
                                       "count's", **{f"{g:g}_gbps": {s: ps_saturation(rows, g, s)
                                                                   for s in ("measured", "predicted")} for g in rates}},
        "allreduce_wins": {"criterion": "the fewest nodes at which allreduce's images/s exceed sync's (measured: by "
                                        "more than 2 standard errors)", **{f"{g:g}_gbps": {s: allreduce_wins(rows, g, s)
                                                                            for s in ("measured", "predicted")}
                                                                         for g in rates}},
        "async_gain_slow_link": {"link_gbps": rates[0], **{s: async_gain(rows, rates[0], s)
                                                            for s in ("measured", "predicted")}},
    }


def study_step() -> dict:
    """The study's step on one K80 die and its batch, from the profile (compute_s: 1.0018 s, 32 images)."""
    from scaletrain.perfmodel.profile import load_profile

    prof, _ = load_profile(ROOT / PROFILE)
    return {"compute_s": prof.compute_s, "batch": prof.batch_per_replica, "gradient_bytes": prof.gradient_bytes,
            "source": f"{PROFILE} [node] compute_s, [workload] batch_per_replica"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 and 4 nodes at 1 Gbit/s, 1 + 4 steps: a smoke run")
    ap.add_argument("--warmup", type=int, default=None, help="steps left out of each row's throughput (default 2)")
    ap.add_argument("--steps", type=int, default=None, help="measured steps of each row (default 8)")
    ap.add_argument("--capacity-gbps", type=float, default=0.0,
                    help="what this machine carries, Gbit/s (0 = measure it with scaletrain twin test)")
    ap.add_argument("--headroom", type=float, default=1.0, help="fraction of the twin test's rate a row may load")
    ap.add_argument("--nodes", type=int, nargs="+", help="node counts of the rows (default 2 4 8; --quick 2 4)")
    ap.add_argument("--rates", type=float, nargs="+", help="link rates, Gbit/s (default 1 10; --quick 1)")
    ap.add_argument("--strategies", nargs="+", choices=[n for n, _ in STRATEGIES],
                    help="the rows' strategies (default all three)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs of each row (bench --repeats): images/s their mean, the spread across them kept")
    ap.add_argument("--time-scale", type=int, default=0,
                    help="every row at this k instead of the smallest within the bounds (one the self-test "
                         "refuses still runs again higher)")
    ap.add_argument("--save", action="store_true", help="also write benchmarks/results/twin-TIME-COMMIT.json")
    ap.add_argument("--predict-again", metavar="RESULTS_JSON", type=Path,
                    help="no run: the rows of a saved run predicted again by this commit's model (the measured "
                         "figures, and the commit that measured them, kept)")
    a = ap.parse_args()
    if a.time_scale < 0 or a.repeats < 1:
        ap.error("--time-scale is 0 (the smallest within the bounds) or a k of at least 1; --repeats at least 1")
    if a.predict_again:
        return predict_again(a.predict_again, a.save)
    a.warmup = a.warmup if a.warmup is not None else (1 if a.quick else 2)
    a.steps = a.steps if a.steps is not None else (4 if a.quick else 8)
    if os.geteuid() != 0:
        sys.exit("twin bench: the cluster twin needs root (network namespaces, veth pairs and tc shaping)")
    import torch

    from scaletrain.metrics import run_info

    t0 = time.monotonic()
    study = study_step()
    cap = {"gbps": a.capacity_gbps, "tests": "given (--capacity-gbps)"} if a.capacity_gbps else capacity()
    budget = a.headroom * cap["gbps"]
    nodes, rates = ([2, 4], [1.0]) if a.quick else ([2, 4, 8], [1.0, 10.0])
    nodes, rates = a.nodes or nodes, a.rates or rates
    with tempfile.TemporaryDirectory() as tmp:
        rows = plan(nodes, rates, budget, Path(tmp), a.strategies, a.time_scale)
    say(f"this machine carries {cap['gbps']:g} Gbit/s (twin test); a row may load {a.headroom:g} x that = "
        f"{budget:g} Gbit/s: time scale k = the smallest of {', '.join(map(str, SERIES))} with load / k <= {budget:g}"
        f" and host work / k <= {HOST_SHARE:g} x the predicted step")
    for r in rows:
        say(f"  {r['link_gbps']:g} Gbit/s, {r['nodes']} nodes {r['strategy']}: load {r['load_gbps']:g} Gbit/s "
            f"({r['load']}), host {host_s(r):.2f} s of a {r['predicted_network_only'].get('step_s', 0):.2f} s step "
            f"-> k = {r['time_scale']}{' (--time-scale)' if a.time_scale else ''}")
    runs = Path(tempfile.mkdtemp(prefix="twin-bench-", dir="/tmp"))
    rows, baselines = measure(rows, a, study, runs)
    with tempfile.TemporaryDirectory() as tmp:
        add_predictions(rows, Path(tmp))
    for r in rows:
        r["host_cpu_s_implied"] = host_implied(r, study["batch"])
    out = {"benchmark": "twin", **run_info(torch.device("cpu")), "cores": os.cpu_count(),
           "command": "python benchmarks/twin.py " + " ".join(sys.argv[1:]),
           "model": "resnet50, 1,200 classes (25,966,832 parameters)", "study_step": study,
           "recipe": RECIPE, "model_sets": MODEL, "predict_recipe": PREDICT_RECIPE, "profile": PROFILE,
           "warmup": a.warmup, "steps": a.steps, "repeats": a.repeats, "capacity": cap, "headroom": a.headroom,
           "load_budget_gbps": budget,
           "host_cpu_s": HOST_CPU_S, "host_share": HOST_SHARE,
           "baselines": baselines, "rows": rows, "findings": findings(rows), "fidelity": fidelity(rows),
           "runs_dir": str(runs),
           "seconds": round(time.monotonic() - t0)}
    emit(out, a.save)


def predict_again(saved: Path, save: bool) -> None:
    """A saved run's rows with this commit's predictions and findings: after a change of the model,
    its figures against the same measurements, which name the commit that measured them."""
    import torch

    from scaletrain.metrics import run_info

    try:
        out = json.loads(saved.read_text())
        rows = out["rows"]
    except (OSError, ValueError, KeyError) as e:
        sys.exit(f"twin bench: {saved}: not a saved twin run ({e})")
    measured = {"measured_by": out["command"], "measured_at": out["git_commit"], "measured_in": str(saved)}
    with tempfile.TemporaryDirectory() as tmp:
        add_predictions(rows, Path(tmp))
    batch = study_step()["batch"]
    for r in rows:  # the gap to the new prediction
        r["host_cpu_s_implied"] = host_implied(r, batch)
    out.update(run_info(torch.device("cpu")), **measured, rows=rows, findings=findings(rows), fidelity=fidelity(rows),
               coverage=band_coverage(rows), command="python benchmarks/twin.py " + " ".join(sys.argv[1:]))
    emit(out, save)


def band_coverage(rows: list[dict]) -> dict:
    """Per prediction ('predicted', 'predicted_network_only'): the fraction of rows whose measured
    images/s lie inside the predicted band (perfmodel/bands.py), or null with the reason."""
    from scaletrain.perfmodel.bands import coverage, no_spread

    def pair(r: dict, key: str) -> tuple:
        return r.get("images_per_sec"), ((r.get(key) or {}).get("band") or {}).get("images_per_sec")
    return {key: coverage([pair(r, key) for r in rows], no_spread(PROFILE))
            for key in ("predicted", "predicted_network_only")}


def emit(out: dict, save: bool) -> None:
    print(json.dumps(out, indent=1))
    if save:
        stamp = time.strftime("%Y-%m-%dT%H%MZ", time.gmtime())
        path = ROOT / "benchmarks" / "results" / f"twin-{stamp}-{out['git_commit'][:7]}.json"
        path.write_text(json.dumps(out, indent=1) + "\n")
        say(f"wrote {path}")


if __name__ == "__main__":
    main()
