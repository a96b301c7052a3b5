"""A GPU cluster's scaling, shown on this CPU machine with emulated GPUs.

Every replica's forward and backward is `train.emulate_compute_s = T`
seconds of sleep and a fixed gradient (the host is idle, as while a GPU
computes); the strategies' communication, PS and optimizer work are real.
All runs are `scaletrain bench` runs (real bench rows, the study's speedup
and efficiency), one replica a node unless said:
  (a) all-reduce on 1, 2, 4, 8, 16 emulated GPUs, beside the ideal speedup = GPUs;
  (b) sync with 1 PS alongside on 1..16 nodes: the PS becomes the bottleneck;
  (c) 4 nodes, node 1 slowed by 2T a step: sync against backup (b = 1);
  (d) sync against mixed-async, 2 and 4 nodes x 2 replicas, 1 PS.

Scaling to this machine. The study's cluster (profiles/study-k80.toml,
ResNet-50, 104 MB gradient) computes a step in 1.0 s; moving the gradient
takes 0.07 s (1.5 GB/s) and the PS's CPU 0.43 s to take it in and apply it
(240 MB/s): (transfer + PS) / compute = 0.5. Here the model is ResNet-18
(45 MB gradient; ResNet-50's 94 MB for 16 processes would not leave the two
cores time to do anything else), and the script first measures, with
perfmodel/calibrate.py's microbenchmarks, the one-way gloo transfer of the
gradient over loopback (G / B) and one optimizer step over it (G / R). The
PS's CPU per gradient is receiving it, applying it and sending the values
back, 2 G/B + G/R (loopback moves bytes with the CPU, which a cluster's
network does not). T = (G/B + 2 G/B + G/R) / 0.5, rounded to 10 ms (--compute-s
sets it). On an idle machine: G/B = 17 ms, G/R = 11 ms, so T = 0.12 s; under
another job's load the measured rates are lower and T longer.

What the machine cannot emulate: every emulated node shares the same two
cores, so an all-reduce's total copying grows with the node count here,
while a cluster spreads it over one link per node; past about 4 nodes the
all-reduce line bends because of this host, not of the algorithm. The PS
is one process, as on the cluster, so (b) is the closer match.

    python benchmarks/emulated.py [--steps 12 --warmup 3 --max-nodes 16 --compute-s T]

Prints one JSON object (about 9 minutes on two cores with another job beside it).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from scaletrain.cli import main as cli
from scaletrain.config import load_config
from scaletrain.metrics import run_info
from scaletrain.perfmodel.calibrate import alpha_beta, measure_comm, measure_optimizer

from strategies import stdout_to_stderr

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "digits.toml"
MODEL = ["model.name=resnet18", "model.num_classes=10", "data.image_size=32"]
STUDY = {"compute_s": 1.0018, "transfer_s": 0.069, "ps_apply_s": 0.43}  # profiles/study-k80.toml


def measure() -> dict:
    """This host's gradient transfer (gloo, loopback) and optimizer step for MODEL, and T from them."""
    cfg = load_config(RECIPE, [*MODEL, "train.eval_every=0"])
    from scaletrain.models import build_model

    numel = sum(p.numel() for p in build_model(cfg.model).parameters())
    nbytes = 4 * numel
    opt_s = measure_optimizer(cfg, numel)
    p2p = measure_comm(2, numel)
    _, bandwidth = alpha_beta(p2p["p2p_1"], p2p[f"p2p_{numel}"], nbytes)
    transfer_s = p2p[f"p2p_{numel}"]
    ps_s = 2 * transfer_s + opt_s
    ratio = (STUDY["transfer_s"] + STUDY["ps_apply_s"]) / STUDY["compute_s"]
    return {"gradient_bytes": nbytes, "transfer_s": transfer_s, "bandwidth": bandwidth, "optimizer_s": opt_s,
            "ps_per_gradient_s": ps_s, "study_ratio": ratio,
            "compute_s": max(0.01, round((transfer_s + ps_s) / ratio, 2))}


def bench(out: Path, sets: list[str], grid: list[str], warmup: int, steps: int) -> list[dict]:
    args = ["bench", "--recipe", str(RECIPE), "--warmup", str(warmup), "--steps", str(steps), "--out", str(out)]
    for s in sets:
        args += ["--set", s]
    for g in grid:
        args += ["--grid", g]
    with stdout_to_stderr():
        cli(args)  # a failed cell is a row with its error
    return json.loads((out / "bench-rows.json").read_text())


def brief(r: dict) -> dict:
    keep = ("label", "strategy", "nodes", "gpus_per_node", "num_ps", "replicas", "images_per_sec",
            "images_per_sec_stderr", "speedup", "speedup_stderr", "efficiency", "staleness_mean",
            "dropped_gradients", "emulated_compute_s", "error")
    out = {k: r.get(k) for k in keep if r.get(k) is not None}
    for k in ("images_per_sec", "images_per_sec_stderr", "speedup", "speedup_stderr", "efficiency", "staleness_mean"):
        if k in out:
            out[k] = round(out[k], 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12, help="measured job steps of each run")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--max-nodes", type=int, default=16)
    ap.add_argument("--compute-s", type=float, default=0.0, help="T in seconds (0 = derive it from measurements)")
    a = ap.parse_args()
    host = measure()
    t = a.compute_s or host["compute_s"]
    nodes = [n for n in (1, 2, 4, 8, 16) if n <= a.max_nodes]
    sets = [*MODEL, f"train.emulate_compute_s={t}", "data.workers=0", "data.batch_size=32", "train.threads=1",
            "optim.schedule=constant", "optim.warmup_steps=0", "train.checkpoint_every=0"]
    result = {"benchmark": "emulated", "model": "resnet18", "emulated_compute_s": t, "measured": host,
              "steps": a.steps, "warmup": a.warmup}
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        rows = bench(d / "scaling", sets, [f"cluster.nodes={','.join(map(str, nodes))}",
                                           "strategy.name+cluster.num_ps=allreduce:0,sync:1"], a.warmup, a.steps)
        result["allreduce"] = [{**brief(r), "ideal_speedup": r["replicas"]} for r in rows
                               if r.get("strategy") == "allreduce"]
        result["sync_1ps"] = [brief(r) for r in rows if r.get("strategy") == "sync"]
        rows = bench(d / "straggler", [*sets, "cluster.nodes=4", "strategy.slow_node=1",
                                       f"strategy.slow_delay_s={round(2 * t, 3)}"],
                     ["strategy.name+cluster.num_ps+strategy.backup_workers=sync:1:0,backup:1:1"], a.warmup, a.steps)
        result["straggler"] = {"slow_node": 1, "slow_delay_s": round(2 * t, 3),
                               "rows": [brief(r) for r in rows if not r.get("added_baseline")]}
        rows = bench(d / "mixed", [*sets, "cluster.gpus_per_node=2"],
                     ["cluster.nodes=2,4", "strategy.name+cluster.num_ps=sync:1,mixed-async:1"], a.warmup, a.steps)
        result["sync_vs_mixed_async"] = [brief(r) for r in rows]
    print(json.dumps({**result, **run_info(torch.device("cpu"))}, indent=2))


if __name__ == "__main__":
    main()
