"""The performance model against this machine and against the study's figures.

1. `scaletrain calibrate` measures a profile here (real processes, gloo);
2. `scaletrain bench` measures a grid of strategies x nodes x PS counts and placements;
3. `scaletrain predict --validate` sets the predictions against the bench;
4. profiles/study-k80.toml predicts the study's four 4-worker configurations.

Prints one JSON object: the calibrated profile, each configuration's measured and
predicted images/s with its error, the median absolute error, and the study rows.

    python benchmarks/perfmodel.py [--out runs/perfmodel] [--steps 30]
"""

from __future__ import annotations

import argparse
import json
import sys
import tomllib
from pathlib import Path

from strategies import stdout_to_stderr

from scaletrain.cli import main as cli
from scaletrain.config import load_config
from scaletrain.perfmodel.predict import predict
from scaletrain.perfmodel.profile import load_profile

ROOT = Path(__file__).resolve().parents[1]
SETS = ["data.workers=0", "optim.warmup_steps=0", "cluster.gpus_per_node=2"]
GRID = ["cluster.nodes=2,3",
        "strategy.name+cluster.num_ps+cluster.ps_placement=allreduce:0:alongside,sync:1:alongside,"
        "sync:2:dedicated,mixed-async:1:alongside,mixed-async:2:alongside,async:1:alongside"]
STUDY = [("1 node (no distribution)", ["cluster.nodes=1", "cluster.num_ps=0", "strategy.name=allreduce"], 124.18),
         ("7 nodes (4 workers + 3 dedicated PS)", ["cluster.num_ps=3", "cluster.ps_placement=dedicated"], 396.62),
         ("4 nodes (4 workers + 3 PS alongside)", ["cluster.num_ps=3"], 374.73),
         ("4 nodes (4 workers + 1 PS alongside)", ["cluster.num_ps=1"], 292.22)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=ROOT / "runs/perfmodel")
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    recipe = str(ROOT / "recipes/digits.toml")
    sets = [a for s in SETS for a in ("--set", s)]
    with stdout_to_stderr():
        rc = cli(["calibrate", "--recipe", recipe, *sets, "--out", str(args.out / "local.toml")])
        rc = rc or cli(["bench", "--recipe", recipe, *sets, *(a for g in GRID for a in ("--grid", g)),
                        "--warmup", "5", "--steps", str(args.steps), "--out", str(args.out / "bench")])
        rc = rc or cli(["predict", "--profile", str(args.out / "local.toml"), "--validate", str(args.out / "bench")])
    if rc:
        sys.exit(rc)
    validated = json.loads((args.out / "bench/validate-rows.json").read_text())
    k80, _ = load_profile(ROOT / "profiles/study-k80.toml")
    study = []
    for name, sets_, measured in STUDY:
        cfg = load_config(ROOT / "recipes/anp-resnet50.toml",
                          ["cluster.gpus_per_node=4", "cluster.nodes=4", "strategy.name=mixed-async", *sets_])
        row = predict(cfg, k80)
        study.append({"setup": name, "measured": measured, "predicted": round(row["images_per_sec"], 2),
                      "error": round(row["images_per_sec"] / measured - 1, 4),
                      "speedup": round(row["speedup"], 3), "efficiency": round(row["efficiency"], 3),
                      "bottleneck": row["bottleneck"]})
    print(json.dumps({
        "profile": tomllib.loads((args.out / "local.toml").read_text()),
        "this_machine": [{"setup": r["label"], "measured": round(r["measured"], 1),
                          "predicted": round(r["predicted"], 1), "error": round(r["rel_error"], 4)}
                         for r in validated["rows"]],
        "median_abs_error": round(validated["median_abs_error"], 4),
        "study_k80_4_workers": study,
    }, indent=1))


if __name__ == "__main__":
    main()
