"""Images/s of every strategy at the same replica count on this machine, in one run.

Each strategy runs as a real local job (processes, gloo) to the same target:
steps x replicas x batch images applied. The figures are the job's: images
applied over the job's training time, on the chief's clock; images computed
(dropped gradients included) are given beside them. The single-process figure
is given for reference. `--slow-delay S` slows the last node's compute by S
seconds an update (a straggler). Prints one JSON object.

    python benchmarks/strategies.py [--nodes 2 --gpus-per-node 2 --steps 60 --batch 32 --slow-delay 0]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

from scaletrain.cli import main as cli
from scaletrain.metrics import run_info
from scaletrain.strategies import REGISTRY

import torch


@contextmanager
def stdout_to_stderr():
    """Runs print progress (and their child processes inherit fd 1): keep stdout for the JSON."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def run_rows(recipe: Path, overrides: list[str]) -> tuple[dict, list[dict]]:
    """A real run's summary and the chief's train rows."""
    with tempfile.TemporaryDirectory() as d, stdout_to_stderr():
        args = ["train", "--recipe", str(recipe), "--run-dir", d, "--quiet"]
        for o in overrides:
            args += ["--set", o]
        if cli(args) != 0:
            raise SystemExit(f"benchmark run failed: {' '.join(overrides)}")
        rows = [json.loads(line) for line in (Path(d) / "metrics.jsonl").read_text().splitlines()]
        return json.loads((Path(d) / "summary.json").read_text()), \
            [r for r in rows if r["kind"] == "train" and r.get("rank", 0) == 0]


def run(recipe: Path, overrides: list[str]) -> dict:
    return run_rows(recipe, overrides)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", type=Path, default=Path(__file__).resolve().parents[1] / "recipes" / "digits.toml")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--gpus-per-node", type=int, default=2)
    ap.add_argument("--num-ps", type=int, default=1)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--slow-delay", type=float, default=0.0, help="seconds added to each update's compute on the last node")
    a = ap.parse_args()
    base = [f"train.steps={a.steps}", "train.eval_every=0", "train.warmup_log_steps=5", "data.workers=0",
            "train.log_every=5", f"data.batch_size={a.batch}"]
    replicas = a.nodes * a.gpus_per_node
    single = run(a.recipe, base)
    rows = []
    for name, e in REGISTRY.items():
        extra = ["strategy.backup_workers=1"] if name == "backup" and a.nodes > 1 else []
        if a.slow_delay:
            extra += [f"strategy.slow_node={a.nodes - 1}", f"strategy.slow_delay_s={a.slow_delay}"]
        s = run(a.recipe, base + [f"strategy.name={name}", f"cluster.nodes={a.nodes}",
                                  f"cluster.gpus_per_node={a.gpus_per_node}",
                                  f"cluster.num_ps={a.num_ps if e.uses_ps else 0}", *extra])
        rows.append({"strategy": name, "images_per_sec": s["images_per_sec"],
                     "images_per_sec_stderr": s["images_per_sec_stderr"], "train_seconds": s["train_seconds"],
                     "images_applied": s["images_applied"], "images_computed": s["images_computed"],
                     "speedup_vs_single": s["images_per_sec"] / single["images_per_sec"],
                     "staleness_mean": s.get("staleness_mean"), "dropped_gradients": s.get("dropped_gradients"),
                     "bytes_per_step": s["bytes_per_step"], "time_split_s": s["time_split_s"]})
    print(json.dumps({"benchmark": "strategies", "replicas": replicas, "nodes": a.nodes,
                      "gpus_per_node": a.gpus_per_node, "num_ps": a.num_ps, "steps": a.steps,
                      "slow_delay_s": a.slow_delay,
                      "batch_per_replica": a.batch, "model": single["model"],
                      "single_process_images_per_sec": single["images_per_sec"], "strategies": rows,
                      **run_info(torch.device("cpu"))}, indent=2))


if __name__ == "__main__":
    main()
