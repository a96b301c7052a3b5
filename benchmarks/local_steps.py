"""local-sgd and diloco against all-reduce: test accuracy at equal images, and bytes sent.

For each replica count, one `scaletrain study` on digits (the recipe's ResNet-8) of all-reduce,
and local-sgd and diloco at each strategy.sync_every, every cell trained for the same epochs (equal
images applied) with the learning rate all-reduce's at that global batch (optim.scale_lr = linear
from 32 images, a 5-step warm-up), 16 images a replica, and with several seeds. Per cell: the test
accuracy (each seed's and their mean), its gap to all-reduce's mean, and the bytes a worker sends a
step, over all-reduce's. Replicas are local processes (gloo, one node per 2 replicas) on this
machine's cores: the times say nothing of a cluster (a study's --bench or --profile clock does).

    python benchmarks/local_steps.py [--replicas 4 8 16] [--sync-every 4 8 16 32] [--epochs 16]
                                     [--seeds 0 1] [--save]

Progress on stderr, one JSON on stdout; --save also writes
benchmarks/results/local-steps-<UTC time>-<short commit>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "digits.toml"
SETS = ["data.workers=0", "data.batch_size=16", "optim.scale_lr=linear", "optim.reference_batch=32",
        "optim.warmup_steps=5", "train.steps=0", "train.eval_every=0", "train.checkpoint_every=0"]


def study(replicas: int, every: list[int], epochs: float, seed: int, out: Path) -> list[dict]:
    """One study of all-reduce and both local strategies at each sync_every: its rows."""
    from scaletrain.cli import main as cli
    from strategies import stdout_to_stderr  # benchmarks/strategies.py: the study's table is not this JSON

    nodes = max(1, replicas // 2)
    cells = ",".join(["allreduce:8"] + [f"{name}:{h}" for name in ("local-sgd", "diloco") for h in every])
    sets = [*SETS, f"cluster.nodes={nodes}", f"cluster.gpus_per_node={replicas // nodes}", f"train.seed={seed}"]
    args = ["study", "--recipe", str(RECIPE), *(a for s in sets for a in ("--set", s)),
            "--grid", f"strategy.name+strategy.sync_every={cells}", "--until", f"epochs={epochs:g}", "--out", str(out)]
    print(f"local steps: {replicas} replicas, seed {seed}: scaletrain {' '.join(args)}", file=sys.stderr, flush=True)
    with stdout_to_stderr():
        code = cli(args)
    if code != 0:
        sys.exit(f"local steps: the study of {replicas} replicas (seed {seed}) failed; see {out}")
    return [json.loads(line) for line in (out / "study.jsonl").read_text().splitlines()]


def table(runs: dict[int, list[dict]]) -> list[dict]:
    """Per cell, over the seeds: accuracies, their mean, the gap to all-reduce's mean, bytes over all-reduce's."""
    by: dict[tuple, list[dict]] = {}
    for rows in runs.values():
        for r in rows:
            by.setdefault((r["cell"]["strategy.name"], int(r["cell"]["strategy.sync_every"])), []).append(r)
    base = by[("allreduce", 8)]
    acc0 = statistics.fmean(r["test_accuracy"] for r in base)
    sent0 = base[0]["bytes_per_step"]["worker_sent"]
    out = []
    for (name, h), rows in by.items():
        acc = [r["test_accuracy"] for r in rows]
        out.append({"strategy": name, "sync_every": h if name != "allreduce" else None, "test_accuracy": acc,
                    "test_accuracy_mean": statistics.fmean(acc), "gap_to_allreduce": statistics.fmean(acc) - acc0,
                    "images_applied": rows[0]["images_applied"],
                    "bytes_per_step": rows[0]["bytes_per_step"]["worker_sent"],
                    "bytes_over_allreduce": rows[0]["bytes_per_step"]["worker_sent"] / sent0,
                    "staleness_mean": rows[0].get("staleness_mean"), "wall_seconds": [r["wall_seconds"] for r in rows]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--sync-every", type=int, nargs="+", default=[4, 8, 16, 32])
    ap.add_argument("--epochs", type=float, default=16)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--save", action="store_true")
    a = ap.parse_args()
    if any(n % 2 and n != 1 for n in a.replicas):
        sys.exit(f"local steps: --replicas {a.replicas}: 1 or an even count (2 replicas a node)")
    import torch

    from scaletrain.metrics import run_info

    t0 = time.monotonic()
    keep = Path(tempfile.mkdtemp(prefix="local-steps-", dir="/tmp"))
    rows = {}
    for n in a.replicas:
        runs = {seed: study(n, a.sync_every, a.epochs, seed, keep / f"r{n}-s{seed}") for seed in a.seeds}
        rows[n] = table(runs)
    out = {"benchmark": "local_steps", **run_info(torch.device("cpu")),
           "command": "python benchmarks/local_steps.py " + " ".join(sys.argv[1:]), "recipe": str(RECIPE.relative_to(ROOT)),
           "sets": SETS, "epochs": a.epochs, "seeds": a.seeds, "studies_dir": str(keep),
           "by_replicas": {str(n): r for n, r in rows.items()}, "seconds": round(time.monotonic() - t0)}
    print(json.dumps(out, indent=1))
    if a.save:
        stamp = time.strftime("%Y-%m-%dT%H%MZ", time.gmtime())
        path = ROOT / "benchmarks" / "results" / f"local-steps-{stamp}-{out['git_commit'][:7]}.json"
        path.write_text(json.dumps(out, indent=1) + "\n")
        print(f"local steps: wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
