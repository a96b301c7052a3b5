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

Nodes are indices from 0 in data (`Proc.node`, JSON) and are called
"node 1", "node 2", ... in text, as the study and most host names count them.
A worker's GPU comes from `gpu_map` (never one shared by two ranks of a host); a PS
uses none.
"""

from __future__ import annotations

from dataclasses import dataclass

from scaletrain.config import ClusterConfig
from scaletrain.errors import PlanError

__all__ = ["ClusterConfig", "Plan", "PlanError", "Proc", "format_table", "make_plan"]


@dataclass(frozen=True)
class Proc:
    """One process of the plan."""

    rank: int             # global rank in the world group
    node: int             # 0-based node index
    local_rank: int       # 0-based index among this node's processes
    role: str             # "worker" | "ps"
    index: int            # worker index among workers, or PS index among PS
    replica: int          # worker: replica (GPU) index within its node; PS: -1
    device: str           # "cuda:K" (K = replica) or "cpu"; PS always "cpu"
    stage: int = 0        # worker: its pipeline stage (parallel.stages), 0 where a replica is one process


@dataclass(frozen=True)
class Plan:
    procs: tuple[Proc, ...]  # indexed by global rank
    nodes_total: int         # worker nodes + dedicated PS nodes
    stages: int = 1          # processes (pipeline stages) a replica takes

    @property
    def replicas(self) -> int:
        """Model replicas: the data-parallel width (workers / stages)."""
        return len(self.workers) // self.stages

    def replica_of(self, p: Proc) -> int:
        """A worker's replica among the job's (its data slice): the stages of one replica share it."""
        return p.index // self.stages

    def pipeline_of(self, p: Proc) -> list[int]:
        """The ranks of the stages of a worker's replica, in stage order."""
        return [q.rank for q in self.workers if self.replica_of(q) == self.replica_of(p)]

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

    def describe(self, rank: int) -> str:
        p = self.procs[rank]
        return f"rank {rank} ({_role(self, p)} on {node_name(p.node)})"

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


def make_plan(cluster: ClusterConfig, ps_required: bool, gpus: int = 0, one_host: bool = False,
              stages: int = 1) -> Plan:
    """The placement for `cluster`; raises PlanError when it cannot be placed.
    gpus: GPUs each host makes visible to the job (0: the workers run on CPUs); one_host: every
    node of the plan runs on this one machine (the local launcher's emulated nodes); stages: the
    processes of a replica (parallel.stages), side by side on a node so that activations cross
    between neighbouring GPUs: slot r of a node is stage r % stages of replica r // stages."""
    n, g, p = cluster.nodes, cluster.gpus_per_node, cluster.num_ps
    if n < 1 or g < 1:
        raise PlanError(f"cluster.nodes = {n}, cluster.gpus_per_node = {g}: both must be >= 1")
    if g % stages:
        raise PlanError(f"cluster.gpus_per_node = {g}: not a multiple of parallel.stages = {stages}")
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

    gpu = gpu_map(n, g, gpus, one_host, cluster.backend == "gloo") if gpus else None
    procs: list[Proc] = []
    for node in range(nodes_total):
        local = 0
        if node < n:
            for r in range(g):
                procs.append(Proc(len(procs), node, local, "worker", node * g + r, r // stages,
                                  f"cuda:{gpu[node * g + r]}" if gpu else "cpu", r % stages))
                local += 1
        if node in ps_on_node:
            procs.append(Proc(len(procs), node, local, "ps", ps_on_node[node], -1, "cpu"))  # CPU work over gloo
    return Plan(tuple(procs), nodes_total, stages)


def gpu_map(nodes: int, per_node: int, gpus: int, one_host: bool, share: bool) -> list[int]:
    """The GPU of each worker (in worker order), an index among those its host makes visible.

    Ranks that share a host never share a GPU: NCCL refuses two ranks of one communicator on one
    GPU ("Duplicate GPU detected"), and two replicas on one GPU would time each other. On its own
    host (torchrun, Slurm) node k's replica r takes GPU r; the local launcher's emulated nodes
    share this machine, so node k's replicas take GPUs k * gpus_per_node + r. share (gloo
    between GPUs, cluster.backend = 'gloo'): replicas may share GPUs, assigned round-robin."""
    on_host = nodes * per_node if one_host else per_node
    if on_host > gpus and not share:
        need = f"{nodes} emulated nodes x {per_node} replicas on this machine need {on_host} GPUs" \
            if one_host and nodes > 1 else f"cluster.gpus_per_node = {per_node} needs {per_node} GPUs on each node"
        raise PlanError(f"{need} but {gpus} {'is' if gpus == 1 else 'are'} visible here: "
                        f"use fewer cluster.nodes or cluster.gpus_per_node, train.device = 'cpu' (also with "
                        "train.emulate_compute_s), or cluster.backend = 'gloo' to let replicas share GPUs")
    return [(w if one_host else w % per_node) % gpus for w in range(nodes * per_node)]


def node_name(node: int) -> str:
    return f"node {node + 1}"


def lost_nodes(plan: Plan, ranks: list[int]) -> dict[str, list[int]]:
    """The lost worker processes `ranks` as summary.json's lost_workers records them: "nodes", their
    nodes numbered from 1 as every message numbers them (node_name: "the job goes on without node 3"
    is [3]; cluster.* keys such as slow_link_node count from 0), and "ranks", numbered as
    torch.distributed numbers them (from 0), as the messages do too ("rank 3 (worker 2 on node 3)")."""
    return {"nodes": sorted({plan.procs[r].node + 1 for r in ranks}), "ranks": list(ranks)}


def _role(plan: Plan, p: Proc) -> str:
    """'worker 3', 'ps 0'; with stages, 'worker 3 (replica 1, stage 2)'."""
    if p.role == "worker" and plan.stages > 1:
        return f"worker {p.index} (replica {plan.replica_of(p)}, stage {p.stage + 1})"
    return f"{p.role} {p.index}"


def _span(xs: list[int]) -> str:
    return f"{xs[0]}-{xs[-1]}" if len(xs) > 1 else str(xs[0])


def node_line(plan: Plan, node: int) -> str:
    """What a node runs, in the study's words: 'PS 0 (no GPU) and worker 1 (GPUs 0-3)'."""
    parts = [f"PS {p.index} (no GPU)" for p in plan.on_node(node) if p.role == "ps"]
    replicas = [p for p in plan.on_node(node) if p.role == "worker"]
    if replicas:
        gpus = [int(p.device[5:]) for p in replicas if p.device.startswith("cuda:")]
        k = len(replicas) // plan.stages
        where = f"GPU{'s' if len(gpus) > 1 else ''} {_span(gpus)}" if gpus else \
            f"{k} CPU replica{'s' if k > 1 else ''}"
        if plan.stages > 1:
            where += f": {k} replica{'s' if k > 1 else ''} x {plan.stages} stages"
        parts.append(f"worker {node} ({where})")
    return f"{node_name(node)}: {' and '.join(parts)}"


def format_table(plan: Plan, addr: str = "", port: int = 0, hosts: list[str] | None = None) -> str:
    """The placement for people: a line per node in the study's words, then a row per process."""
    n_ps_nodes = plan.nodes_total - plan.worker_nodes
    lines = [f"{plan.nodes_total} node{'s' if plan.nodes_total > 1 else ''} "
             f"({plan.worker_nodes} with workers, {n_ps_nodes} PS-only), {plan.world_size} processes"]
    lines += [node_line(plan, n) for n in range(plan.nodes_total)]
    w = max(8, *(len(_role(plan, p)) for p in plan.procs))
    lines += ["", f"{'node':<8} {'host':<12} {'rank':>4} {'local':>5}  {'role':<{w}} {'GPU':<5} port"]
    for p in plan.procs:
        host = hosts[p.node] if hosts else "-"
        gpu = p.device[5:] if p.device.startswith("cuda:") else "none"
        listens = f"{port or 'any free'} (rendezvous{' at ' + addr if addr else ''})" if p.rank == 0 else "-"
        lines.append(f"{p.node + 1:<8} {host:<12} {p.rank:>4} {p.local_rank:>5}  {_role(plan, p):<{w}} "
                     f"{gpu:<5} {listens}")
    return "\n".join(lines)
