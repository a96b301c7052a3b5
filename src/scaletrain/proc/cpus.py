"""The CPU budget of a Slurm job: what each plan node needs, and the threads each process takes.

A worker process needs its data.workers loader processes (one CPU each: they decode and augment
while the GPU works) and its training threads, train.threads or 1 (a GPU replica's Python thread
launches kernels; more threads buy nothing there). A PS shard needs no loader: it applies its
optimizer to its share of the parameters (ResNet-50: 26M floats over num_ps shards), element-wise
work that torch spreads over as many threads as it is given. So a PS asks for cluster.ps_threads
CPUs, or at least 1 when that is 0, and then takes every CPU of its node's allocation that the
node's workers do not use: on a node given whole (--exclusive) that is the rest of the node.

One srun step has one --cpus-per-task for all its tasks, so per-role CPUs cannot be said to
Slurm task by task. The allocation asks every node for the most any plan node needs (one batch
slot per node with that many CPUs); the job step asks no CPU count, so it holds all of them
(launch/slurm.step_layout), its tasks share their node's CPUs unbound, and each process sets its
own thread count from `threads`, a pure function of the plan and of the CPUs Slurm gave each
node (SLURM_JOB_CPUS_PER_NODE).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import LaunchError
from ..plan import Plan, node_name


@dataclass(frozen=True)
class NodeNeed:
    node: int          # plan node index
    workers: int       # worker processes on it
    loaders: int       # loader processes per worker (data.workers)
    worker_threads: int
    ps: tuple[int, ...]  # PS indices on it
    ps_threads: int    # CPUs a PS asks for (it takes the rest of its node's CPUs)

    @property
    def cpus(self) -> int:
        return self.workers * (self.loaders + self.worker_threads) + len(self.ps) * self.ps_threads

    def words(self) -> str:
        """'4 workers x (2 loaders + 1 thread) + PS 0 (1 thread at least)' and so on."""
        parts = []
        if self.workers:
            t = self.worker_threads
            per = f"{self.loaders} loader{'s' * (self.loaders != 1)} + {t} thread{'s' * (t != 1)}"
            parts.append(f"{self.workers} worker{'s' * (self.workers != 1)} x ({per})")
        for k in self.ps:
            parts.append(f"PS {k} ({self.ps_threads} thread{'s' * (self.ps_threads != 1)} at least)")
        return " + ".join(parts)


def node_needs(plan: Plan, cfg) -> list[NodeNeed]:
    """What each plan node needs, in node order."""
    loaders, threads = cfg.data.workers, max(1, cfg.train.threads)
    ps_threads = max(1, cfg.cluster.ps_threads)
    return [NodeNeed(n, sum(p.role == "worker" for p in plan.on_node(n)), loaders, threads,
                     tuple(p.index for p in plan.on_node(n) if p.role == "ps"), ps_threads)
            for n in range(plan.nodes_total)]


def threads(plan: Plan, cfg, node_cpus: list[int]) -> list[int]:
    """Torch threads of every process, by rank, given the CPUs Slurm gave each plan node. A worker
    takes train.threads (at least 1); a PS its node's CPUs less its workers' loaders and threads,
    shared with any other PS there. Raises LaunchError when a node got fewer CPUs than it needs."""
    needs = node_needs(plan, cfg)
    if len(node_cpus) < len(needs):
        raise LaunchError(f"the plan has {len(needs)} nodes; CPUs are known for {len(node_cpus)}")
    out = []
    for p in plan.procs:
        need, cpus = needs[p.node], node_cpus[p.node]
        if cpus < need.cpus:
            raise LaunchError(f"{node_name(p.node)} needs {need.cpus} CPUs ({need.words()}); Slurm gave it {cpus}")
        if p.role == "worker":
            out.append(need.worker_threads)
        else:
            left = cpus - need.workers * (need.loaders + need.worker_threads)
            out.append(max(need.ps_threads, left // len(need.ps)))
    return out


def expand_counts(text: str) -> list[int]:
    """SLURM_JOB_CPUS_PER_NODE ('16(x3),13') -> [16, 16, 16, 13]."""
    out = []
    for item in filter(None, text.split(",")):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if not m:
            raise LaunchError(f"cannot read Slurm's CPU counts {text!r} at {item!r}")
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def fitting_workers(need: NodeNeed, cpus: int) -> int:
    """The most data.workers with which `need`'s node fits in `cpus` (-1: none does)."""
    if not need.workers:
        return -1
    rest = cpus - len(need.ps) * need.ps_threads
    return rest // need.workers - need.worker_threads
