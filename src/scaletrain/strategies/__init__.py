"""The strategy registry: the only place that maps strategy names to behaviour.

Each entry gives the worker-side class (and its options) and, for PS
strategies, the server's mode: how many node gradients a shard waits for,
and whether the job trains on when a worker node is lost (`survivable`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .allreduce import AllReduce
from .async_allreduce import AsyncAllReduce
from .base import Strategy
from .ps_client import PSClient


@dataclass(frozen=True)
class Entry:
    make: Callable[..., Strategy]
    uses_ps: bool
    server: str = ""      # "sync": wait for a version's gradients | "async": apply each at once
    per_node: bool = True  # one pusher per node (averaged inside) or one per replica
    backups: bool = False  # a version may go without strategy.backup_workers node gradients
    survives_loss: bool = False  # no update waits for every node: the job goes on without a lost one
    resizable: bool = False  # every replica holds the one state: a resume may change the node count
    rounds: bool = False   # all-reduce rounds in the background; replicas never wait for them


REGISTRY: dict[str, Entry] = {
    "allreduce": Entry(AllReduce, uses_ps=False, resizable=True),
    "async-allreduce": Entry(AsyncAllReduce, uses_ps=False, resizable=True, rounds=True),
    "sync": Entry(PSClient, uses_ps=True, server="sync"),
    "backup": Entry(PSClient, uses_ps=True, server="sync", backups=True, survives_loss=True),
    "mixed-async": Entry(PSClient, uses_ps=True, server="async", survives_loss=True),
    "async": Entry(PSClient, uses_ps=True, server="async", per_node=False, survives_loss=True),
}


def entry(cfg) -> Entry:
    return REGISTRY[cfg.strategy.name]


def build_strategy(cfg, ctx, model, optimizer, schedule) -> Strategy:
    if cfg.strategy.emulate_workers:
        from .emulate import EmulatedAsync

        return EmulatedAsync(cfg, ctx, model, optimizer, schedule, cfg.strategy.emulate_workers, entry(cfg).rounds)
    e = entry(cfg)
    options = {"per_node": e.per_node} if e.uses_ps else {}
    return e.make(cfg, ctx, model, optimizer, schedule, **options)


def pushers(cfg, plan) -> list[int]:
    """Ranks that talk to the parameter servers: node leaders, or every replica."""
    return list(plan.leaders) if entry(cfg).per_node else [p.rank for p in plan.workers]


def push_images(cfg) -> int:
    """Images behind one push: a node's replicas, or one replica's batch."""
    return cfg.data.batch_size * (cfg.cluster.gpus_per_node if entry(cfg).per_node else 1)


def images_per_update(cfg) -> int:
    """Images whose gradients one update applies: the global batch (all-reduce, sync),
    N-b nodes' batches (backup), one push (asynchronous modes). The learning-rate
    scaling rule (optim.scale_lr) is in this unit, on the PS and in all-reduce alike."""
    e, c = entry(cfg), cfg.cluster
    if cfg.strategy.emulate_workers:  # one process: a gradient of one batch, or a round of K (emulate.py)
        return cfg.data.batch_size * (cfg.strategy.emulate_workers if e.rounds else 1)
    if not e.uses_ps:
        return c.nodes * c.gpus_per_node * cfg.data.batch_size
    return push_images(cfg) * (wait_for(cfg, c.nodes if e.per_node else c.nodes * c.gpus_per_node)
                               if e.server == "sync" else 1)


def wait_for(cfg, pushers: int) -> int:
    """Gradients a synchronous shard needs per version: all, less the backups."""
    return pushers - (cfg.strategy.backup_workers if entry(cfg).backups else 0)


def tolerant(cfg) -> bool:
    """Whether the job goes on without a lost worker node (then no collective joins the
    workers: agreed points meet at the shards, see ps/server.py)."""
    return entry(cfg).survives_loss and not cfg.strategy.emulate_workers


def lost_with(plan, rank: int) -> list[int]:
    """`rank` and the workers lost with it: its node's, which average and broadcast with it every step."""
    node = plan.procs[rank].node
    return sorted({rank} | {p.rank for p in plan.workers if p.node == node})


def survivable(cfg, plan, lost) -> bool:
    """Whether the job trains on without the processes `lost` (ranks): only workers, never the
    chief's node (it evaluates, checkpoints and serves the rendezvous), and under backup at most
    strategy.backup_workers nodes (each update still gets its N-b node gradients)."""
    if not lost or not tolerant(cfg) or any(plan.procs[r].role != "worker" for r in lost):
        return False
    nodes = {plan.procs[r].node for r in lost}
    if plan.workers[0].node in nodes:
        return False
    return not entry(cfg).backups or len(nodes) <= cfg.strategy.backup_workers
