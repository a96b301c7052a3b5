"""The performance model against this machine and against the study's figures.

For each regime, plain (every replica computes on this host's CPU cores) and
emulated (`train.emulate_compute_s`: each replica sleeps as a GPU would
compute and pushes a fixed gradient of the model's real size, while every
transfer, PS and optimizer step is real; see README, "Emulated GPUs"):

1. `scaletrain calibrate` measures a profile here (real processes, gloo);
2. `scaletrain bench` measures 12 configurations: 2 and 3 nodes x 2 replicas;
   allreduce, sync with 1 PS alongside or 2 dedicated, mixed-async with 1 or
   2 PS, async; then sync and backup (b = 1) on 3 nodes with node 1 slowed;
3. `scaletrain predict --validate` sets the predictions against the bench:
   throughput, mean and p95 staleness, dropped gradients.

Emulated steps are mostly sleep: one calibration of 3 rounds, then one pass
over the grid. Plain steps take tens of milliseconds of this host's CPU and
follow its slow and fast spells, which last minutes: a calibration made before
the bench measures another host than the bench does. So the plain regime runs
in 3 windows, each a calibration of one round followed at once by one pass over
the grid; the profile is the median of the 3 (calibrate.median_profile) and
each configuration's measurement the mean of its 3 passes (mean_rows), as
`bench --repeats 3` gives it.

Then profiles/study-k80.toml predicts the study's 4-worker configurations and
sync against mixed-async at 2 to 16 nodes.

Prints one JSON object (about 20 minutes on two quiet cores). --study-only
measures nothing and runs only the study's predictions (seconds); --save also
writes the object to benchmarks/results/perfmodel-<UTC time>-<short commit>.json.

    python benchmarks/perfmodel.py [--out runs/perfmodel] [--steps 30] [--regimes plain emulated] [--rescore]
                                   [--study-only] [--save]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import tomllib
from pathlib import Path

from strategies import stdout_to_stderr

from scaletrain.cli import main as cli
from scaletrain.config import build_config, load_config
from scaletrain.metrics import git_commit, run_info
from scaletrain.perfmodel.bands import band, coverage, field_spreads, no_spread
from scaletrain.perfmodel.predict import add_time, predict
from scaletrain.perfmodel.calibrate import median_profile, rederive
from scaletrain.perfmodel.profile import dump_profile, load_profile

ROOT = Path(__file__).resolve().parents[1]
RECIPE = str(ROOT / "recipes/digits.toml")
COMMON = ["data.workers=0", "optim.warmup_steps=0", "cluster.gpus_per_node=2"]
# Emulated: ResNet-18's 45 MB gradient and 0.12 s a step, so that moving and applying the
# gradient weigh against compute about as in the study (benchmarks/emulated.py says how).
EMULATED_T = 0.12
# Per regime: its settings, the slowed node's extra seconds a step, the windows (each a
# calibration followed by one pass over the grid), the calibration's rounds in each (above) and
# the timed steps of its jobs. A plain job of 30 steps times 0.6 s, in which one stall of the
# host moves its step by a fifth (seen: 19 to 29 ms between runs minutes apart): 120.
REGIMES = {"plain": ([], 0.1, 3, 1, 120),
           "emulated": (["model.name=resnet18", "data.image_size=32", "train.eval_every=0",
                         f"train.emulate_compute_s={EMULATED_T}"],
                        2 * EMULATED_T, 1, 3, 30)}
GRID = ["cluster.nodes=2,3",
        "strategy.name+cluster.num_ps+cluster.ps_placement=allreduce:0:alongside,sync:1:alongside,"
        "sync:2:dedicated,mixed-async:1:alongside,mixed-async:2:alongside,async:1:alongside"]
SLOWED = ["cluster.nodes=3", "cluster.num_ps=1", "strategy.slow_node=1",
          "strategy.name+strategy.backup_workers=sync:0,backup:1"]
STUDY = [("1 node (no distribution)", ["cluster.nodes=1", "cluster.num_ps=0", "strategy.name=allreduce"], 124.18),
         ("7 nodes (4 workers + 3 dedicated PS)", ["cluster.num_ps=3", "cluster.ps_placement=dedicated"], 396.62),
         ("4 nodes (4 workers + 3 PS alongside)", ["cluster.num_ps=3"], 374.73),
         ("4 nodes (4 workers + 1 PS alongside)", ["cluster.num_ps=1"], 292.22)]
SYNC_VS_ASYNC = [(2, 1), (4, 3), (8, 7), (16, 7)]


def sets_of(items: list[str]) -> list[str]:
    return [a for s in items for a in ("--set", s)]


def grids_of(items: list[str]) -> list[str]:
    return [a for g in items for a in ("--grid", g)]


def regime(name: str, out: Path, steps: int, rescore: bool = False) -> dict:
    extra, slow_s, windows, rounds, calibration_steps = REGIMES[name]
    sets = sets_of(COMMON + extra)
    bench = ["--warmup", "5", "--steps", str(steps)]
    profiles, dirs = [], []
    with stdout_to_stderr():
        for w in range(windows):
            print(f"{name}: window {w + 1} of {windows}", flush=True)
            win = out / f"window{w + 1}" if windows > 1 else out
            profiles.append(win / "local.toml")
            dirs += [win / "bench", win / "slowed"]
            if rescore:  # this version's profile from the calibration's measurements; the bench as it ran
                again = rederive(profiles[-1], load_config(RECIPE, COMMON + extra))
                profiles[-1] = win / "local-rescored.toml"
                profiles[-1].write_text(dump_profile(*again))
                continue
            rc = cli(["calibrate", "--recipe", RECIPE, *sets, "--runs", str(rounds), "--steps", str(calibration_steps),
                      "--out", str(profiles[-1])])
            rc = rc or cli(["bench", "--recipe", RECIPE, *sets, *grids_of(GRID), *bench, "--out", str(dirs[-2])])
            rc = rc or cli(["bench", "--recipe", RECIPE, *sets, "--set", f"strategy.slow_delay_s={slow_s}",
                            *grids_of(SLOWED), *bench, "--out", str(dirs[-1])])
            if rc:
                sys.exit(rc)
        prof = profiles[0]
        if windows > 1:
            prof = out / "local.toml"
            prof.write_text(dump_profile(*median_profile(profiles)))
            dirs = [mean_rows(dirs[k::2], out / kind) for k, kind in enumerate(("bench", "slowed"))]
        rc = cli(["predict", "--profile", str(prof), "--validate", *map(str, dirs), "--out", str(out)])
    if rc:
        sys.exit(rc)
    validated = json.loads((out / "validate-rows.json").read_text())
    profile = tomllib.loads(prof.read_text())

    def pair(r: dict, key: str) -> list:
        return [None if r[f"{key}_{s}"] is None else round(r[f"{key}_{s}"], 3) for s in ("measured", "predicted")]

    bands, covered = throughput_bands(validated["rows"], prof)
    return {
        "profile": {k: v for section, table in profile.items() if section != "about" for k, v in table.items()},
        "calibration_spread": profile["about"]["spread"],
        "coverage": covered,
        "rows": [{"setup": r["label"], "measured": round(r["measured"], 1), "predicted": round(r["predicted"], 1),
                  "band": b and [round(b[0], 1), round(b[1], 1)],
                  "inside": None if b is None else b[0] <= r["measured"] <= b[1],
                  "error": round(r["rel_error"], 4), "staleness_mean": pair(r, "staleness_mean"),
                  "staleness_p95": pair(r, "staleness_p95"), "dropped_fraction": pair(r, "dropped_fraction"),
                  "bottleneck": r["bottleneck"], "bench": str(Path(r["bench_dir"]).relative_to(out))}
                 for r, b in zip(validated["rows"], bands)],
        "configurations": len(validated["rows"]),
        "median_abs_error": round(validated["median_abs_error"], 4),
        "speedup_median_abs_error": round(validated["speedup_median_abs_error"], 4),
        "staleness_median_abs_error": validated["staleness_median_abs_error"],
    }


def throughput_bands(validated: list[dict], prof: Path) -> tuple[list, dict]:
    """Each validated row's band on throughput from the profile's spread (perfmodel/bands.py;
    the median of the windows' calibrations, or one calibration's rounds), and the coverage: the
    fraction of measured throughputs inside their bands. None and the reason where the profile
    gives no spread."""
    profile, about = load_profile(prof)
    spreads = field_spreads(about)
    out = []
    for r in validated:
        if not spreads:
            out.append(None)
            continue
        cfg = bench_config(r)
        row = predict(cfg, profile)
        b = band(row, profile, spreads, lambda q, cfg=cfg: predict(cfg, q))
        out.append(b["images_per_sec"] if b else None)
    return out, coverage([(r["measured"], b) for r, b in zip(validated, out)], "" if spreads else no_spread(str(prof)))


def bench_config(r: dict):
    """The config of a validated row, from the bench row it was predicted for (as validate.py reads it)."""
    rows = json.loads((Path(r["bench_dir"]) / "bench-rows.json").read_text())
    row = next(b for b in rows if (b.get("label"), b.get("cell")) == (r["label"], r["cell"]))
    nested: dict[str, dict] = {}
    for k, v in row["config"].items():
        sec, key = k.split(".", 1)
        nested.setdefault(sec, {})[key] = v
    return build_config(nested)


def mean_rows(dirs: list[Path], out: Path) -> Path:
    """The bench rows of several passes over one grid as one bench output in `out`: each row's
    throughput the mean of its passes (its spread across them as the standard error), its
    staleness and dropped fraction the means."""
    passes = [json.loads((d / "bench-rows.json").read_text()) for d in dirs]
    rows = []
    for same in zip(*passes):
        if any(r.get("error") for r in same):
            rows.append(next(r for r in same if r.get("error")))
            continue
        row = dict(same[0])
        ips = [r["images_per_sec"] for r in same]
        row.update(images_per_sec=statistics.fmean(ips), images_per_sec_runs=ips,
                   images_per_sec_run_stderr=statistics.stdev(ips) / len(ips) ** 0.5,
                   images_per_sec_stderr=statistics.fmean(r.get("images_per_sec_stderr") or 0.0 for r in same)
                   / len(ips) ** 0.5)
        for k in ("staleness_mean", "staleness_p95", "dropped_fraction"):
            if row.get(k) is not None:
                row[k] = statistics.fmean(r[k] for r in same)
        rows.append(row)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench-rows.json").write_text(json.dumps(rows, indent=1))
    return out


def study() -> dict:
    k80, about = load_profile(ROOT / "profiles/study-k80.toml")
    spreads = field_spreads(about)  # none: the profile is set from published figures
    recipe = ROOT / "recipes/anp-resnet50.toml"
    rows = []
    for name, sets_, measured in STUDY:
        cfg = load_config(recipe, ["cluster.gpus_per_node=4", "cluster.nodes=4", "strategy.name=mixed-async", *sets_])
        row = predict(cfg, k80)
        b = (band(row, k80, spreads, lambda q, cfg=cfg: predict(cfg, q)) or {}).get("images_per_sec")
        rows.append({"setup": name, "measured": measured, "predicted": round(row["images_per_sec"], 2),
                     "band": b and [round(b[0], 2), round(b[1], 2)],
                     "error": round(row["images_per_sec"] / measured - 1, 4), "bottleneck": row["bottleneck"]})
    covered = coverage([(r["measured"], r["band"]) for r in rows], no_spread("profiles/study-k80.toml"))
    versus = []
    for nodes, ps in SYNC_VS_ASYNC:
        rate = {s: predict(load_config(recipe, ["cluster.gpus_per_node=4", f"cluster.nodes={nodes}",
                                                f"cluster.num_ps={ps}", f"strategy.name={s}"]), k80)["images_per_sec"]
                for s in ("sync", "mixed-async")}
        hours = add_time({"images_per_sec": rate["sync"]}, k80.dataset_images, k80.epochs).get("train_hours")
        versus.append({"nodes": nodes, "ps_alongside": ps, "sync": round(rate["sync"], 1),
                       "mixed_async": round(rate["mixed-async"], 1),
                       "sync_over_mixed_async": round(rate["sync"] / rate["mixed-async"], 3),
                       "sync_train_hours": None if hours is None else round(hours, 1)})
    return {"study_k80_4_workers": rows, "study_k80_coverage": covered, "sync_vs_mixed_async": versus}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=ROOT / "runs/perfmodel")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--regimes", nargs="+", choices=list(REGIMES), default=list(REGIMES))
    ap.add_argument("--rescore", action="store_true",
                    help="measure nothing: score the model of this version on the calibrations and bench rows "
                         "an earlier run left in --out")
    ap.add_argument("--study-only", action="store_true",
                    help="measure nothing here: only profiles/study-k80.toml's predictions of the study")
    ap.add_argument("--save", action="store_true", help="also write benchmarks/results/perfmodel-TIME-COMMIT.json")
    args = ap.parse_args()
    regimes = [] if args.study_only else args.regimes
    result = {**{name: regime(name, args.out / name, args.steps, args.rescore) for name in regimes}, **study()}
    print(json.dumps(result, indent=1))
    if args.save:
        save(result)


def save(result: dict) -> None:
    """The result with the command that made it, where it ran, and whether the tree differed from
    its commit (a figure of a dirty tree is not the commit's)."""
    import torch  # heavy: only for the device's description

    commit, stamp = git_commit(), time.strftime("%Y-%m-%dT%H%MZ", time.gmtime())
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip() != ""
    out = ROOT / "benchmarks" / "results" / f"perfmodel-{stamp}-{commit[:7]}.json"
    out.write_text(json.dumps({"benchmark": "perfmodel", "command": "python " + " ".join(sys.argv),
                               **run_info(torch.device("cpu")), "git_dirty": dirty, "cpus": os.cpu_count(),
                               **result}, indent=1) + "\n")
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
