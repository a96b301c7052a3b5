"""Staleness: the accuracy asynchronous updates lose, and what staleness-aware updates win back.

Every run trains digits (recipes/digits.toml, group norm, no augmentation) on
the same number of images and reports its final test accuracy, the mean over
--seeds seeds (each seed its own initialisation and data order):

(a) K asynchronous workers emulated in one process (strategy.emulate_workers =
    K: every gradient, of a batch of b images, is applied K-1 updates after the
    version it was computed on), for K = 8, 16, 32, against synchronous
    training of K workers on the same images: one process stepping on batches
    of K x b, as a synchronous update averages the K workers' gradients. Both
    scale the learning rate linearly with the images per update (lr at b
    images; K x lr for sync, reached by a warm-up), as a synchronous job's
    recipe would. Then the remedies on the asynchronous workers:
    strategy.staleness_lr = inverse (lr / (staleness + 1)), DC-ASGD
    (strategy.delay_compensation = lambda). Inverse lr runs at lr and at the
    synchronous run's K x lr: at lr each stale gradient moves the values K
    times less than in sync. Then less momentum (see remedies()): 0.5, and
    none with DC-ASGD, each at half the step lr / (1 - momentum). Beside them, the companion talk's
    async-allreduce emulated with K replicas whose rounds take a step (each
    update the mean of K gradients, one update stale; its lr scaled as sync's).
(b) the same on real processes: 4 nodes of 1 replica, 1 PS alongside, sync
    against mixed-async, plain and with the remedies.

    python benchmarks/staleness.py [--seeds 2] [--workers 8 16 32] [--epochs E]

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

RECIPE = str(Path(__file__).resolve().parents[1] / "recipes/digits.toml")
TRAIN_IMAGES = 1437  # digits' training split
BATCH = 8  # images per worker per step
ROUNDS = "async-allreduce"
COMMON = ["model.norm=group", "data.augment=none", "data.workers=0", "train.eval_every=0",
          "train.checkpoint_every=0", "train.log_every=50", "optim.schedule=constant", "optim.scale_lr=linear",
          f"optim.reference_batch={BATCH}"]


def remedies(lr: float, k: int, lam: float) -> dict[str, list[str]]:
    """The asynchronous variants, at lr unless said: plain; inverse lr at lr (each gradient at
    about lr / k in steady state) and at the synchronous run's k x lr (about lr, as much as a
    synchronous update gives each of its gradients); DC-ASGD. Then less momentum: delayed
    gradients act as momentum of their own (Mitliagkas et al. 2016), and with the recipe's 0.9
    the stable step shrinks; these take half the step lr / (1 - momentum) of the others, with
    momentum 0.5, and with none under DC-ASGD at 10 x lambda."""
    return {"async": [f"optim.lr={lr}"],
            "inverse lr": [f"optim.lr={lr}", "strategy.staleness_lr=inverse"],
            f"inverse lr at the sync lr ({k * lr:g})": [f"optim.lr={k * lr}", "strategy.staleness_lr=inverse"],
            f"DC-ASGD (lambda {lam:g})": [f"optim.lr={lr}", f"strategy.delay_compensation={lam}"],
            f"momentum 0.5 (lr {2.5 * lr:g})": ["optim.momentum=0.5", f"optim.lr={2.5 * lr:g}"],
            f"DC-ASGD (lambda {10 * lam:g}), no momentum (lr {5 * lr:g})": [
                "optim.momentum=0", f"optim.lr={5 * lr:g}", f"strategy.delay_compensation={10 * lam:g}"]}


class Runs:
    """Training runs, `parallel` at a time (one thread each), each a `scaletrain train` process."""

    def __init__(self, tmp: Path, seeds: int, parallel: int) -> None:
        self.tmp, self.seeds, self.pool = tmp, seeds, ThreadPoolExecutor(parallel)

    def accuracy(self, name: str, sets: list[str], seeds: int | None = None):
        """The runs started; a call of what this returns waits for them and gives the mean final
        test accuracy over the seeds, and each one's."""
        runs = [self.pool.submit(self._one, f"{name}-seed{seed}", [*sets, f"train.seed={seed}"])
                for seed in range(seeds or self.seeds)]
        return lambda: _mean([r.result() for r in runs])

    def _one(self, name: str, sets: list[str]) -> dict:
        run_dir = self.tmp / name.replace(" ", "_").replace("(", "").replace(")", "")
        cmd = [sys.executable, "-m", "scaletrain", "train", "--recipe", RECIPE, "--run-dir", str(run_dir), "--quiet",
               *sum((["--set", s] for s in (*COMMON, "train.threads=1", *sets)), [])]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"{name}: scaletrain train exited {r.returncode}: {r.stderr.strip()[-500:]}")
        s = json.loads((run_dir / "summary.json").read_text())
        print(f"{name}: accuracy {s['test_accuracy']:.4f}, staleness {s.get('staleness_mean') or 0:.2f}, "
              f"{s['wall_seconds']:.0f} s", file=sys.stderr, flush=True)
        return s


def _mean(summaries: list[dict]) -> dict:
    accs = [s["test_accuracy"] for s in summaries]
    return {"accuracy": round(statistics.fmean(accs), 4),
            "accuracy_std": round(statistics.stdev(accs), 4) if len(accs) > 1 else 0.0,
            "accuracies": accs, "staleness_mean": round(statistics.fmean(s.get("staleness_mean") or 0.0
                                                                          for s in summaries), 2)}


def emulated(runs: Runs, k: int, images: int, lr: float, warmup: int, lam: float):
    steps = images // (k * BATCH)  # sync updates; the asynchronous workers apply k times as many
    rows = {"sync": runs.accuracy(f"k{k}-sync", [f"data.batch_size={k * BATCH}", f"train.steps={steps}",
                                                  f"optim.lr={lr}", f"optim.warmup_steps={warmup}"])}
    for name, extra in remedies(lr, k, lam).items():
        rows[name] = runs.accuracy(f"k{k}-{name}", [f"data.batch_size={BATCH}", f"train.steps={k * steps}",
                                                     f"strategy.emulate_workers={k}", *extra])
    # the talk's strategy: k replicas, every update the mean of their k gradients, one update stale
    rows[ROUNDS] = runs.accuracy(f"k{k}-{ROUNDS}", [
        f"data.batch_size={BATCH}", f"train.steps={k * steps}", f"strategy.name={ROUNDS}",
        f"strategy.emulate_workers={k}", f"optim.lr={lr}", f"optim.warmup_steps={k * warmup}"])
    return lambda: table({"workers": k, "images": k * steps * BATCH}, rows)


def real(runs: Runs, nodes: int, images: int, lr: float, warmup: int, lam: float, seeds: int):
    steps = images // (nodes * BATCH)
    cluster = [f"cluster.nodes={nodes}", "cluster.gpus_per_node=1", "cluster.num_ps=1", f"data.batch_size={BATCH}",
               f"train.steps={steps}"]
    rows = {"sync": runs.accuracy(f"real{nodes}-sync", [*cluster, "strategy.name=sync", f"optim.lr={lr}",
                                                        f"optim.warmup_steps={warmup}"], seeds)}
    for name, extra in remedies(lr, nodes, lam).items():
        rows[name.replace("async", "mixed-async", 1)] = runs.accuracy(
            f"real{nodes}-{name}", [*cluster, "strategy.name=mixed-async", *extra], seeds)
    return lambda: table({"nodes": nodes, "images": steps * nodes * BATCH}, rows)


def table(head: dict, futures: dict) -> dict:
    rows = {name: f() for name, f in futures.items()}
    plain = next(n for n in rows if n.endswith("async"))
    best = max((n for n in rows if n not in ("sync", plain, ROUNDS)), key=lambda n: rows[n]["accuracy"])
    return {**head, "rows": rows, "gap": round(rows["sync"]["accuracy"] - rows[plain]["accuracy"], 4),
            "best_remedy": best, "best_remedy_gap": round(rows["sync"]["accuracy"] - rows[best]["accuracy"], 4)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", nargs="+", type=int, default=[8, 16, 32])
    ap.add_argument("--nodes", type=int, default=4, help="real mixed-async job (0: skip)")
    ap.add_argument("--epochs", type=float, default=20.0)
    ap.add_argument("--lr", type=float, default=0.02, help="learning rate at BATCH images an update")
    ap.add_argument("--warmup", type=int, default=20, help="sync: warm-up steps to the scaled lr")
    ap.add_argument("--dc-lambda", type=float, default=10.0)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--real-seeds", type=int, default=1, help="seeds of the real jobs (each takes minutes)")
    ap.add_argument("--parallel", type=int, default=2, help="emulator runs at once, one thread each")
    ap.add_argument("--out", type=Path, help="keep the runs here (default: a temporary directory)")
    args = ap.parse_args()
    images = int(args.epochs * TRAIN_IMAGES)
    with tempfile.TemporaryDirectory() as t:
        runs = Runs(args.out or Path(t), args.seeds, args.parallel)
        pending = [emulated(runs, k, images, args.lr, args.warmup, args.dc_lambda) for k in args.workers]
        emulator = [p() for p in pending]
        # The real job's processes share the cores: run alone, after the emulator.
        real_job = real(Runs(runs.tmp, args.real_seeds, 1), args.nodes, images, args.lr, args.warmup,
                        args.dc_lambda, args.real_seeds)() if args.nodes else None
    result = {"task": f"digits, batch {BATCH} a worker, {args.epochs:g} epochs ({images} images), lr {args.lr} "
                      f"at {BATCH} images an update, scaled linearly", "seeds": args.seeds, "emulated": emulator}
    if real_job:
        result["real"] = {**real_job, "seeds": args.real_seeds}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
