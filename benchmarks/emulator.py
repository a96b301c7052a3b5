"""How close the one-process staleness emulator comes to real mixed-async runs.

For each N: a real `mixed-async` job of N nodes x 1 replica (1 PS, T job
steps, so N*T updates of one node's batch) against `strategy.emulate_workers
= N` in one process (N*T steps at the same batch and constant learning rate).
Compares mean staleness and the loss curve (the chief's loss at job step s,
i.e. after N*s updates, against the emulator's after N*s updates; both are
means over a log window), with the
gap between two real runs of different seeds as the yardstick. Prints one
JSON object.

    python benchmarks/emulator.py [--nodes 2 4 --steps 100]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from scaletrain.metrics import run_info

import torch

from strategies import run_rows

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "digits.toml"


def train(overrides: list[str]) -> tuple[dict, list[dict]]:
    return run_rows(RECIPE, overrides)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--steps", type=int, default=100, help="job steps of the real run (updates per node, on average)")
    a = ap.parse_args()
    base = ["optim.schedule=constant", "optim.warmup_steps=0", "data.workers=0", "train.eval_every=0"]
    results = []
    for n in a.nodes:
        log = 10
        real, real_rows = train([*base, f"cluster.nodes={n}", "cluster.num_ps=1", "strategy.name=mixed-async",
                                 f"train.steps={a.steps}", f"train.log_every={log}"])
        emu, emu_rows = train([*base, f"strategy.emulate_workers={n}", f"train.steps={n * a.steps}",
                               f"train.log_every={n * log}"])
        # The yardstick: how far two real runs differing only in their seed are apart.
        _, other_rows = train([*base, f"cluster.nodes={n}", "cluster.num_ps=1", "strategy.name=mixed-async",
                               f"train.steps={a.steps}", f"train.log_every={log}", "train.seed=1"])
        pairs = list(zip([r["loss"] for r in real_rows], [r["loss"] for r in emu_rows]))
        gaps = [abs(x - y) / x for x, y in pairs]
        seed_gaps = [abs(x["loss"] - y["loss"]) / x["loss"] for x, y in zip(real_rows, other_rows)]
        results.append({
            "workers": n, "updates": n * a.steps,
            "staleness_mean_real": real["staleness_mean"], "staleness_mean_emulated": emu["staleness_mean"],
            "loss_curve_real": [round(x, 4) for x, _ in pairs], "loss_curve_emulated": [round(y, 4) for _, y in pairs],
            "loss_mean_relative_gap": sum(gaps) / len(gaps),
            "loss_mean_relative_gap_between_real_seeds": sum(seed_gaps) / len(seed_gaps),
            "final_loss_real": real["final_train_loss"], "final_loss_emulated": emu["final_train_loss"],
            "test_accuracy_real": real["test_accuracy"], "test_accuracy_emulated": emu["test_accuracy"],
        })
    print(json.dumps({"benchmark": "emulator", "steps_per_node": a.steps, "results": results,
                      **run_info(torch.device("cpu"))}, indent=2))


if __name__ == "__main__":
    main()
