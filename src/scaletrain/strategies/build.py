"""build_strategy: the only map from a strategy's name to the class that runs it."""

from __future__ import annotations

from .allreduce import AllReduce
from .async_allreduce import AsyncAllReduce
from .base import Strategy
from .emulate import EmulatedAsync
from .local import LocalSteps
from .ps_client import PSClient
from .traits import entry

CLASSES: dict[str, type[Strategy]] = {
    "allreduce": AllReduce, "async-allreduce": AsyncAllReduce, "local-sgd": LocalSteps, "diloco": LocalSteps,
    "sync": PSClient, "backup": PSClient, "mixed-async": PSClient, "async": PSClient,
}


def build_strategy(cfg, ctx, model, optimizer, schedule) -> Strategy:
    """The strategy of cfg wrapped around this replica's model and optimizer. With
    strategy.emulate_workers, the one-process emulation of it (emulate.py)."""
    e = entry(cfg)
    if cfg.strategy.emulate_workers:
        return EmulatedAsync(cfg, ctx, model, optimizer, schedule, cfg.strategy.emulate_workers, e.rounds)
    options = {"per_node": e.per_node} if e.uses_ps else {}
    return CLASSES[cfg.strategy.name](cfg, ctx, model, optimizer, schedule, **options)
