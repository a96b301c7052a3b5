"""Placement: which process runs where, in which role, on which device.

Every process computes the same Plan from the same ClusterConfig, so nothing
but the rendezvous is negotiated at run time. The local launcher, torchrun and
Slurm all start processes from it.

Rules (after the study's launcher, with one process per replica instead of one
process driving all GPUs of a node):
- each of `nodes` worker nodes runs `gpus_per_node` workers, one per replica;
- PS alongside: at most one PS per node, kept off node 0 (the chief's node)
  while another node can take it; PS k goes to node (k + 1) % nodes;
- PS dedicated: PS k gets a node of its own, node nodes + k;
- ranks are contiguous per node in node order, workers (replica order) before
  the PS, so a torchrun agent's global rank is node offset + local rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from scaletrain.config import ClusterConfig

__all__ = ["ClusterConfig", "Plan", "PlanError", "Proc", "format_table", "make_plan"]


class PlanError(ValueError):
    """A cluster shape that cannot be placed; str() is one line for the user."""


@dataclass(frozen=True)
class Proc:
    """One process of the plan.

    `device` names the physical GPU (cuda:<replica>); a launcher that also sets
    CUDA_VISIBLE_DEVICES=`visible_devices` must open it as cuda:0 instead.
    """

    rank: int             # global rank in the world group
    node: int             # 0-based node index
    local_rank: int       # 0-based index among this node's processes
    role: str             # "worker" | "ps"
    index: int            # worker index among workers, or PS index among PS
    replica: int          # worker: replica (GPU) index within its node; PS: -1
    device: str           # "cuda:K" or "cpu"; PS always "cpu"
    visible_devices: str  # CUDA_VISIBLE_DEVICES: worker "K" with GPUs, else ""


@dataclass(frozen=True)
class Plan:
    procs: tuple[Proc, ...]  # indexed by global rank
    nodes_total: int         # worker nodes + dedicated PS nodes

    @property
    def world_size(self) -> int:
        return len(self.procs)

    @property
    def workers(self) -> tuple[Proc, ...]:
        return tuple(p for p in self.procs if p.role == "worker")

    @property
    def ps(self) -> tuple[Proc, ...]:
        return tuple(sorted((p for p in self.procs if p.role == "ps"), key=lambda p: p.index))

    def on_node(self, n: int) -> tuple[Proc, ...]:
        return tuple(p for p in self.procs if p.node == n)

    def node_of(self, rank: int) -> int:
        return self.procs[rank].node

    @property
    def procs_per_node(self) -> list[int]:
        counts = [0] * self.nodes_total
        for p in self.procs:
            counts[p.node] += 1
        return counts

    @property
    def worker_nodes(self) -> int:
        return len({p.node for p in self.workers})

    @property
    def leaders(self) -> list[int]:
        """Rank of replica 0 on each worker node, in node order."""
        return [p.rank for p in self.workers if p.replica == 0]


def make_plan(cluster: ClusterConfig, ps_required: bool, use_gpu: bool = False) -> Plan:
    """The placement for `cluster`; raises PlanError when it cannot be placed."""
    n, g, p = cluster.nodes, cluster.gpus_per_node, cluster.num_ps
    if n < 1 or g < 1:
        raise PlanError(f"cluster.nodes = {n}, cluster.gpus_per_node = {g}: both must be >= 1")
    if ps_required and p == 0:
        raise PlanError("strategy needs at least one parameter server: set cluster.num_ps >= 1")
    if not ps_required and p > 0:
        raise PlanError(f"cluster.num_ps = {p}: this strategy uses no parameter server; set cluster.num_ps = 0")
    dedicated = cluster.ps_placement == "dedicated"
    if not dedicated and p > n:
        raise PlanError(f"cluster.num_ps = {p} > cluster.nodes = {n}: ps_placement = 'alongside' puts at "
                        f"most one PS per node; lower num_ps or use ps_placement = 'dedicated'")

    nodes_total = n + p if dedicated else n
    ps_on_node: dict[int, int] = {}  # node -> PS index
    for k in range(p):
        # (k + 1) % n keeps node 0, the chief's, free until every other node has a PS.
        ps_on_node[n + k if dedicated else (k + 1) % n] = k

    procs: list[Proc] = []
    for node in range(nodes_total):
        local = 0
        if node < n:
            for r in range(g):
                procs.append(Proc(len(procs), node, local, "worker", node * g + r, r,
                                  f"cuda:{r}" if use_gpu else "cpu", str(r) if use_gpu else ""))
                local += 1
        if node in ps_on_node:
            # A PS only does CPU work over gloo; hiding GPUs keeps it from creating a CUDA context.
            procs.append(Proc(len(procs), node, local, "ps", ps_on_node[node], -1, "cpu", ""))
    return Plan(tuple(procs), nodes_total)


def format_table(plan: Plan) -> str:
    """Plain-text placement table, one line per process, grouped by node."""
    lines = [f"{'role':<10} {'rank':>5} {'local':>5}  devices"]
    for node in range(plan.nodes_total):
        procs = plan.on_node(node)
        lines.append(f"node {node} ({len(procs)} process{'es' if len(procs) != 1 else ''})")
        for p in procs:
            lines.append(f"  {p.role + ' ' + str(p.index):<8} {p.rank:>5} {p.local_rank:>5}  "
                         f"{p.visible_devices or 'none'}")
    return "\n".join(lines)
