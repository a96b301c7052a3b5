"""Pipeline stages on this host: the bubble, the activations sent and the memory of each stage.

For each configuration (parallel.stages S x replicas, one emulated node, allreduce, synthetic
images, `scaletrain train` with the local launcher) one job of a few steps; per stage, from its
summary.json: the measured idle fraction (the time the stage's schedules ran less the time it
computed, over its replicas) beside the formula's (S - 1) / (M + S - 1), the bytes of activations
and gradients it sent a step beside M x the micro-batch's boundary activation (from the split's
profile), and its peak memory (the process's peak resident set on a CPU: the libraries' few
hundred MB included). On 2 cores the processes of a configuration share the cores, so a stage
waiting for a core is counted busy, and one waiting for its neighbour idle: the bubble measured
here is the schedule's plus the host's.

--acceptance: ResNet-50 at 224 px, 2 stages x 2 replicas (4 processes) against one process with
the replica's batch, a few steps each: every stage's peak below the single process's.

    python benchmarks/pipeline.py [--model resnet50 --image-size 64 --batch 16 --microbatches 4]
                                  [--stages 1 2 4 --replicas 1 2] [--acceptance] [--save]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def job(tmp: Path, name: str, model: str, size: int, batch: int, micro: int, stages: int, replicas: int,
        steps: int, schedule: str) -> dict:
    """One configuration's job, `scaletrain train` in a process of its own (its peak memory its own)."""
    sets = [f"model.name={model}", "model.num_classes=10", "model.norm=group", "data.name=synthetic",
            f"data.image_size={size}", f"data.batch_size={batch}", "data.workers=0", "data.augment=none",
            f"data.synthetic_size={batch * replicas * (steps + 1)}", f"train.steps={steps}", "train.log_every=1",
            "train.warmup_log_steps=1", "train.eval_every=0", "train.threads=1", "train.device=cpu",
            f"cluster.gpus_per_node={stages * replicas}", f"parallel.stages={stages}",
            f"parallel.microbatches={micro}", f"parallel.schedule={schedule}"]
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-m", "scaletrain", "train", "--recipe", str(ROOT / "recipes" / "digits.toml"),
                    "--run-dir", str(tmp / name), "--quiet",
                    *[a for kv in sets for a in ("--set", kv)]], check=True, stdout=subprocess.DEVNULL,
                   env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    s = json.loads((tmp / name / "summary.json").read_text())
    row = {"stages": stages, "replicas": replicas, "microbatches": micro, "schedule": schedule,
           "images_per_sec": round(s["images_per_sec"], 2), "peak_memory_bytes": s["peak_memory_bytes"],
           "seconds": round(time.monotonic() - t0, 1)}
    if stages == 1:
        return row
    p = s["pipeline"]
    row["bubble_formula"] = round(p["bubble_formula"], 3)
    row["per_stage"] = [{"stage": x["stage"], "layers": f"{x['first']}..{x['last']}",
                         "idle_fraction": round(x["idle_fraction"], 3),
                         "activation_bytes_per_step": int(x["activation_bytes_per_step"]),
                         "activation_bytes_formula": micro * _boundary(p["stages"], x["stage"] - 1),
                         "peak_memory_bytes": x["peak_memory_bytes"]} for x in p["stages"]]
    return row


def _boundary(stages: list[dict], k: int) -> int:
    """Bytes stage k sends a micro-batch: its output's activations (forward) or its input's gradient
    (backward), both of them for a middle stage."""
    out = stages[k]["activation_bytes"]
    back = stages[k - 1]["activation_bytes"] if k > 0 else 0
    return out + back


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--image-size", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16, help="images a replica, a step")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--stages", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--schedule", default="1f1b", choices=("1f1b", "gpipe"))
    ap.add_argument("--acceptance", action="store_true", help="ResNet-50 at 224 px, 2 stages x 2 replicas")
    ap.add_argument("--save", action="store_true", help="also write benchmarks/results/pipeline-TIME-COMMIT.json")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    import torch

    from scaletrain.metrics import run_info

    t0, rows = time.monotonic(), []
    with tempfile.TemporaryDirectory() as tmp:
        if args.acceptance:
            grid = [("single", "resnet50", 224, 8, 4, 1, 1, 3), ("2x2", "resnet50", 224, 8, 4, 2, 2, 3)]
        else:
            grid = [(f"s{s}r{r}", args.model, args.image_size, args.batch, args.microbatches, s, r, args.steps)
                    for s in args.stages for r in args.replicas]
        for name, *spec in grid:
            print(f"{name} ...", file=sys.stderr, flush=True)
            rows.append(job(Path(tmp), name, *spec, schedule=args.schedule))
    out = {"benchmark": "pipeline", **run_info(torch.device("cpu")), "cores": os.cpu_count(),
           "model": "resnet50" if args.acceptance else args.model,
           "image_size": 224 if args.acceptance else args.image_size, "rows": rows,
           "seconds": round(time.monotonic() - t0), "command": "python benchmarks/pipeline.py " + " ".join(sys.argv[1:])}
    if args.acceptance:
        single = rows[0]["peak_memory_bytes"]
        out["stage_peak_below_single"] = all(x["peak_memory_bytes"] < single for x in rows[1]["per_stage"])
    print(json.dumps(out, indent=1))
    if args.save:
        stamp = time.strftime("%Y-%m-%dT%H%MZ", time.gmtime())
        kind = "pipeline-acceptance" if args.acceptance else "pipeline"
        path = ROOT / "benchmarks" / "results" / f"{kind}-{stamp}-{out['git_commit'][:7]}.json"
        path.write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
