"""Time to accuracy, predicted against measured: updates to a target accuracy at 1, 2, 4 and 8 nodes,
predicted from runs in one process (perfmodel/statistical.py), against real jobs of that many nodes.

Every run trains digits (recipes/digits.toml with group norm, no augmentation, a constant learning
rate) with nodes of 1 replica of BATCH images, until its test accuracy reaches --target (evaluated
every EVAL_IMAGES images or so), --seeds times, each seed its own initialisation and data order.

The inputs, each one process on this machine, per seed:
- the 1-node run: BATCH images an update at --lr, its gradient noise scale measured from half its
  batch (train.noise_every = 1): the updates to the target there and the noise scale;
- an emulator run: strategy.emulate_workers = EMULATED (every gradient EMULATED - 1 updates stale),
  at BATCH images and --lr: the cost of staleness (updates to the target at staleness tau over the
  synchronous ones, g^tau), which `predict` applies up to the staleness it measured (a row past it
  says beyond_emulator).
From them, scaletrain's own read_learning() predicts the updates to the target of each configuration:
allreduce and sync (a parameter server) at N nodes, N x BATCH images an update; mixed-async at N
nodes, each node's update of BATCH images applied asynchronously, at the mean staleness its real job
measured (the performance model predicts the staleness itself; `scaletrain predict --validate` checks
that part). The synchronous jobs scale lr with optim.scale_lr = noise at the mean measured noise scale,
the rule the prediction assumes. The measured jobs are real processes (gloo), launched as a user
launches them; the 1-node rows are the inputs and are left out of the error.

Three estimates of the law's batch are set side by side: the gradient noise scale measured along
the 1-node run (predicted_updates, error); the critical batch the law itself fits, seed by seed, to
the 1-node run and runs at FIT_BATCHES images an update, trained by the jobs' lr rule
(predicted_updates_fit, error_fit; statistical.fitted); and the same law fitted once to every
seed's runs, the median at each update size (predicted_updates_pooled, error_pooled: what
`predict --learning` does with all the runs given to it). The first two have a band from the
seeds' predictions, each widened by its test set's error; the pooled one the band `predict` gives
(the seeds' spread and the fit's residuals, statistical.Learning.band); each says whether the
measured mean lies inside it (coverage). --model trains another network: tta_nets:plain_cnn is a BN-free
one, not used while the method was developed.

    python benchmarks/time_to_accuracy.py [--seeds 3] [--target 0.93] [--model tta_nets:plain_cnn] [--save]

Prints one JSON object: per configuration, the measured updates (each seed, mean, min..max) and the
predicted ones (the median of the seeds' predictions), their relative error, and the median
absolute error over the configurations. About 15 minutes on two cores for the BN-free networks
at 4 seeds, 25 for ResNet-8.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = str(ROOT / "recipes" / "digits.toml")
BATCH = 16  # images per replica per step; 1 replica a node
FIT_BATCHES = (48, 96)  # the other update sizes the law is fitted at: no node count's update (16 x N)
EMULATED = 5  # workers of the emulator run: staleness 4, above what 8 real nodes here reach
EVAL_IMAGES = 32  # evaluate about every this many images applied (at least every job step)
COMMON = ["data.augment=none", "data.workers=0", "train.threads=1", "optim.schedule=constant",
          "optim.warmup_steps=0", "train.checkpoint_every=0", "train.log_every=5", "train.steps=4000",
          f"data.batch_size={BATCH}", f"optim.reference_batch={BATCH}"]


class Runs:
    def __init__(self, tmp: Path, target: float, parallel: int) -> None:
        self.tmp, self.target, self.pool = tmp, target, ThreadPoolExecutor(parallel)

    def start(self, name: str, sets: list[str], step_images: int):
        """The run started; what it returns gives its directory, None where it did not reach the target."""
        every = max(1, EVAL_IMAGES // step_images)
        return self.pool.submit(self._one, name, [*sets, f"train.eval_every={every}",
                                                  f"train.target_accuracy={self.target}"])

    def _one(self, name: str, sets: list[str]) -> Path | None:
        run_dir = self.tmp / name
        cmd = [sys.executable, "-m", "scaletrain", "train", "--recipe", RECIPE, "--run-dir", str(run_dir), "--quiet",
               *sum((["--set", s] for s in (*COMMON, *sets)), [])]
        t0 = time.monotonic()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "benchmarks"),
                                                                         os.environ.get("PYTHONPATH")]))}
        r = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if r.returncode:
            raise SystemExit(f"{name}: scaletrain train exited {r.returncode}: {r.stderr.strip()[-500:]}")
        s = json.loads((run_dir / "summary.json").read_text())
        if not s.get("target_reached"):
            print(f"{name}: did not reach accuracy {self.target} in {s['steps']} steps", file=sys.stderr, flush=True)
            return None
        print(f"{name}: target after {s['images_to_target']} images, staleness {s.get('staleness_mean') or 0:.2f}, "
              f"{time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
        return run_dir


def seeds_band(learned: list, update: int, staleness: float) -> list[float]:
    """The band of the predicted updates: the seeds' predictions from lowest to highest, each edge
    widened by that seed's own half-width (its test set's error, Learning.band)."""
    low = min(x.updates_at(update, staleness) * (1 - x.band()) for x in learned)
    high = max(x.updates_at(update, staleness) * (1 + x.band()) for x in learned)
    return [round(low, 1), round(high, 1)]


def updates_to_target(run_dir: Path, update: int) -> float:
    return json.loads((run_dir / "summary.json").read_text())["images_to_target"] / update


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--target", type=float, default=0.93, help="test accuracy to reach")
    ap.add_argument("--lr", type=float, default=0.05, help="learning rate at BATCH images an update")
    ap.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--parallel", type=int, default=2, help="runs at a time")
    ap.add_argument("--model", default="", help="model.name to train instead of the recipe's group-norm ResNet-8, "
                    "e.g. tta_nets:plain_cnn (BN-free, benchmarks/tta_nets.py)")
    ap.add_argument("--save", action="store_true", help="also write benchmarks/results/time-to-accuracy-TIME-COMMIT.json")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    import torch

    from scaletrain.metrics import run_info
    from scaletrain.perfmodel.statistical import read_learning

    seeds = range(args.seeds)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        runs = Runs(Path(tmp), args.target, args.parallel)
        lr_net = [f"optim.lr={args.lr}", f"model.name={args.model}" if args.model else "model.norm=group"]
        ref = [runs.start(f"ref-seed{s}", [*lr_net, "train.noise_every=1", f"train.seed={s}"], BATCH) for s in seeds]
        emu = [runs.start(f"emulated-seed{s}", [*lr_net, f"strategy.emulate_workers={EMULATED}", f"train.seed={s}"],
                          BATCH) for s in seeds]
        # an emulator run that never reached the target (stale gradients it could not absorb) leaves the
        # asynchronous rows unpredicted; the synchronous ones need only the reference run
        stale_ok = all(e.result() is not None for e in emu)
        learned = [read_learning([r.result(), *([e.result()] if stale_ok else [])], ("accuracy", args.target))
                   for r, e in zip(ref, emu)]
        noise = statistics.fmean(x.noise_scale for x in learned)
        rule = [*lr_net, "optim.scale_lr=noise", f"optim.noise_scale={noise:.1f}"]
        # the law's own critical batch: one process at each of FIT_BATCHES images an update, the lr by the jobs' rule
        fit_ref = [[runs.start(f"ref{b}-seed{s}", [*rule, "train.noise_every=1", f"train.seed={s}",
                                                    f"data.batch_size={b}"], b) for b in FIT_BATCHES] for s in seeds]
        stale_runs = [e.result() for e in emu] if stale_ok else []
        fits = [read_learning([r.result(), *(f.result() for f in fs), *stale_runs[s:s + 1]], ("accuracy", args.target))
                for s, (r, fs) in enumerate(zip(ref, fit_ref))]
        pooled = read_learning([*(r.result() for r in ref), *(f.result() for fs in fit_ref for f in fs), *stale_runs],
                               ("accuracy", args.target))
        jobs = {}
        for n in args.nodes:
            cluster = [f"cluster.nodes={n}", "cluster.gpus_per_node=1"]
            jobs["allreduce", n] = [runs.start(f"allreduce{n}-seed{s}", [*rule, *cluster, f"train.seed={s}"],
                                               n * BATCH)
                                    for s in seeds]
            jobs["sync", n] = [runs.start(f"sync{n}-seed{s}", [*rule, *cluster, "strategy.name=sync", "cluster.num_ps=1",
                                                                f"train.seed={s}"], n * BATCH) for s in seeds]
            if n > 1 and stale_ok:
                jobs["mixed-async", n] = [runs.start(f"mixed{n}-seed{s}", [*lr_net, *cluster, "strategy.name=mixed-async",
                                                                           "cluster.num_ps=1", f"train.seed={s}"],
                                                     n * BATCH) for s in seeds]
        rows = []
        for (name, n), futures in jobs.items():
            dirs = [f.result() for f in futures]
            update = BATCH if name == "mixed-async" else n * BATCH
            if None in dirs:  # a seed that never got there: no steps to compare with
                rows.append({"strategy": name, "nodes": n, "images_per_update": update, "input": n == 1,
                             "not_reached": sum(d is None for d in dirs)})
                continue
            measured = [updates_to_target(d, update) for d in dirs]
            stale = [json.loads((d / "summary.json").read_text()).get("staleness_mean") or 0.0 for d in dirs]
            tau = statistics.fmean(stale)
            stale_of = tau if name == "mixed-async" else 0.0
            predicted = statistics.median(x.updates_at(update, stale_of) for x in learned)
            by_fit = statistics.median(x.updates_at(update, stale_of) for x in fits)
            by_pool = pooled.updates_at(update, stale_of)
            band_pool = [round(by_pool * (1 - pooled.band()), 1), round(by_pool * (1 + pooled.band()), 1)]
            mean = statistics.fmean(measured)
            band, band_fit = seeds_band(learned, update, stale_of), seeds_band(fits, update, stale_of)
            rows.append({"strategy": name, "nodes": n, "images_per_update": update, "measured_updates": measured,
                         "measured_mean": round(mean, 1), "measured_min": min(measured), "measured_max": max(measured),
                         "staleness_mean": round(tau, 2), "predicted_updates": round(predicted, 1),
                         "error": round(predicted / mean - 1, 3), "predicted_updates_fit": round(by_fit, 1),
                         "error_fit": round(by_fit / mean - 1, 3), "predicted_updates_pooled": round(by_pool, 1),
                         "error_pooled": round(by_pool / mean - 1, 3), "band": band, "band_fit": band_fit,
                         "band_pooled": band_pool, "inside": band[0] <= mean <= band[1],
                         "inside_fit": band_fit[0] <= mean <= band_fit[1],
                         "inside_pooled": band_pool[0] <= mean <= band_pool[1],
                         "input": n == 1,
                         "beyond_emulator": tau > 1.05 * min(x.staleness_max for x in learned)})
    scored = [abs(r["error"]) for r in rows if not r["input"] and "error" in r]
    scored_fit = [abs(r["error_fit"]) for r in rows if not r["input"] and "error_fit" in r]
    scored_pool = [abs(r["error_pooled"]) for r in rows if not r["input"] and "error_pooled" in r]
    banded = [r for r in rows if not r["input"] and "band" in r]
    out = {"benchmark": "time_to_accuracy", **run_info(torch.device("cpu")), "cores": os.cpu_count(),
           "target_accuracy": args.target, "seeds": args.seeds,
           "batch_per_replica": BATCH, "lr": args.lr, "noise_scale_mean": round(noise, 1),
           "noise_scales": [round(x.noise_scale, 1) for x in learned],
           "staleness_factors": [round(x.staleness_factor, 3) for x in learned] if stale_ok else
           f"the emulator at staleness {EMULATED - 1} did not reach the target: asynchronous rows not run",
           "model": args.model or "resnet8 (group norm)", "fit_batches": [BATCH, *FIT_BATCHES],
           "critical_batches_fit": [round(x.noise_scale, 1) for x in fits],
           "critical_batch_pooled": round(pooled.noise_scale, 1),
           "median_abs_error": round(statistics.median(scored), 3), "max_abs_error": round(max(scored), 3),
           "median_abs_error_fit": round(statistics.median(scored_fit), 3),
           "max_abs_error_fit": round(max(scored_fit), 3),
           "median_abs_error_pooled": round(statistics.median(scored_pool), 3),
           "max_abs_error_pooled": round(max(scored_pool), 3),
           "coverage": round(sum(r["inside"] for r in banded) / len(banded), 3),
           "coverage_fit": round(sum(r["inside_fit"] for r in banded) / len(banded), 3),
           "coverage_pooled": round(sum(r["inside_pooled"] for r in banded) / len(banded), 3),
           "seconds": round(time.monotonic() - t0), "rows": rows,
           "command": "python benchmarks/time_to_accuracy.py " + " ".join(sys.argv[1:])}
    print(json.dumps(out, indent=1))
    if args.save:
        stamp = time.strftime("%Y-%m-%dT%H%MZ", time.gmtime())
        path = ROOT / "benchmarks" / "results" / f"time-to-accuracy-{stamp}-{out['git_commit'][:7]}.json"
        path.write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
