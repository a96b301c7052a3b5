"""The configuration to ask for: for each number of nodes, the best strategy, number of
PS and placement under the model, with the runners-up and why they lose.

Candidates for T nodes: every strategy of the registry; for those with
parameter servers, PS counts of 1, 2, 3, 5, 7, ... (odd counts spread tensors
better) up to T alongside the workers, or T - p workers with p dedicated PS
nodes; backup strategies with one backup node. The objective ranks them;
configurations below --min-efficiency or above --max-staleness are left out.
Images whose gradients a backup strategy drops count for nothing in the ranking.
"""

from __future__ import annotations

import sys
from typing import Any

from ..config import Config
from ..strategies import REGISTRY
from .predict import predict
from .profile import Profile
from .setup import ModelError

def node_counts(max_nodes: int) -> list[int]:
    counts, n = [], 1
    while n < max_nodes:
        counts.append(n)
        n *= 2
    return counts + [max_nodes]


def ps_counts(limit: int) -> list[int]:
    return [p for p in (1, 2, 3, 5, 7, 9, 11, 13, 15, 16, 24, 32, 48, 64) if p <= limit]


def candidates(cfg: Config, total: int) -> list[Config]:
    out = []
    for name, e in REGISTRY.items():
        shapes = [(total, 0, "alongside")] if not e.uses_ps else \
            [(total, p, "alongside") for p in ps_counts(total)] + \
            [(total - p, p, "dedicated") for p in ps_counts(total - 1)]
        for workers, p, where in shapes:
            if e.backups and workers < 2:
                continue  # a backup needs a second node
            out.append(cfg.replace(**{"strategy.name": name, "strategy.backup_workers": 1 if e.backups else 0,
                                      "cluster.nodes": workers, "cluster.num_ps": p, "cluster.ps_placement": where}))
    return out


def value(row: dict[str, Any], objective: str) -> float:
    """The objective, counting only gradients that are applied."""
    return row["images_per_sec" if objective == "throughput" else "efficiency"] * (1 - row["dropped_fraction"])


def why(loser: dict[str, Any], best: dict[str, Any], objective: str) -> str:
    """'-17% throughput; PS CPU busy 0.83 of the step; mean staleness 7.0'."""
    others = {k: v for k, v in loser["busy"].items() if k != "compute"}
    limit = max(others, key=others.get)
    reason = f"{value(loser, objective) / value(best, objective) - 1:+.0%} {objective}; {limit} busy " \
             f"{others[limit]:.2f} of the step"
    if loser["dropped_fraction"]:
        reason += f"; drops {loser['dropped_fraction']:.0%} of gradients"
    if loser.get("staleness_mean"):
        reason += f"; mean staleness {loser['staleness_mean']:.1f}"
    if loser["nodes_total"] > best["nodes_total"]:
        reason += f"; uses {loser['nodes_total']} nodes"
    return reason


def recommend(cfg: Config, p: Profile, max_nodes: int, objective: str = "throughput",
              min_efficiency: float = 0.0, max_staleness: float | None = None, spread: float = 0.0,
              runners_up: int = 3, progress: bool = True) -> list[dict[str, Any]]:
    """One entry per node count: {"nodes": T, "best": row, "runners_up": [(row, reason), ...],
    "considered": n}; best is None when no candidate meets the limits."""
    out = []
    for total in node_counts(max_nodes):
        rows = []
        for c in candidates(cfg, total):
            try:
                rows.append(predict(c, p, spread))
            except ModelError:
                continue  # a shape the profile's nodes cannot hold
        ok = [r for r in rows if r["efficiency"] >= min_efficiency
              and (max_staleness is None or (r["staleness_mean"] or 0.0) <= max_staleness)]
        top = max((value(r, objective) for r in ok), default=1.0)
        # Near-ties (within 1%) go to the fresher gradients, then to fewer PS.
        ok.sort(key=lambda r: (-round(value(r, objective) / top, 2), r["staleness_mean"] or 0.0, r["num_ps"]))
        best = ok[0] if ok else None
        out.append({"nodes": total, "best": best, "considered": len(rows),
                    "runners_up": [(r, why(r, best, objective)) for r in ok[1:1 + runners_up]]})
        if progress:
            print(f"  {total} node{'s' if total > 1 else ''}: {len(rows)} configurations", file=sys.stderr, flush=True)
    return out


def recommend_table(entries: list[dict[str, Any]], objective: str) -> str:
    from ..figures import setup

    lines = [f"| Nodes | Recommended ({objective}) | img/s | Speedup | Efficiency | Runners-up and why they lose |",
             "|---|---|---|---|---|---|"]
    for e in entries:
        b = e["best"]
        if b is None:
            lines.append(f"| {e['nodes']} | none meets the limits ({e['considered']} considered) | | | | |")
            continue
        losers = "; ".join(f"{setup(r)}: {reason}" for r, reason in e["runners_up"]) or "-"
        lines.append(f"| {e['nodes']} | {setup(b)} | {b['images_per_sec']:.1f} | {b['speedup']:.2f} | "
                     f"{b['efficiency']:.2f} | {losers} |")
    return "\n".join(lines)
