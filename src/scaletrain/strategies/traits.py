"""The strategies' traits: what each synchronisation strategy is, as data, without torch.

REGISTRY is the one table of strategy names; the functions below are pure functions of it and
of a config. The launcher, `scaletrain plan`, config validation and the performance model read
it without importing torch; the classes that run a strategy are picked from it in build.py
alone. No other module compares strategy names.

Words used here and by the strategies:
- pusher: a worker process that talks to the parameter-server (PS) shards itself: a node's
  leader, pushing the gradient averaged over the node's replicas (per_node), or every replica.
- server mode: what a PS shard does with the gradients of one version: "sync" waits for
  `wait_for` pushers' gradients and applies their mean; "async" applies each as it arrives.
- update: one step of a PS shard's (or the replicas') optimizer; `images_per_update` is the
  images whose gradients one update applies, the unit of the learning-rate scaling rule.
- tolerant: the job trains on without a lost worker node (then no collective joins the workers
  after start-up: they meet at the shards, see ps/server.py).
- local steps: a replica applies its own gradient alone and meets the others every
  strategy.sync_every steps (local.py).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Traits:
    uses_ps: bool
    server: str = ""      # the PS shards' mode: "sync" | "async" ("" without PS)
    per_node: bool = True  # one pusher per node (averaged inside) or one per replica
    backups: bool = False  # a version may go without strategy.backup_workers node gradients
    survives_loss: bool = False  # no update waits for every node: the job goes on without a lost one
    # With cluster.survive_loss, the job goes on without a lost node too: all-reduce's group re-forms among the
    # survivors (comm/ring.py), sync's shards wait for the pushers left
    reforms: bool = False
    # With cluster.replacements, a replacement for a dropped replica joins and takes a live one's state (the ring)
    heals: bool = False
    resizable: bool = False  # every replica holds the one state: a resume may change the node count
    rounds: bool = False   # all-reduce rounds in the background; replicas never wait for them
    # Replicas step alone between meetings every strategy.sync_every steps, where they "average" their weights
    # (local SGD) or apply the averaged change through an "outer" optimizer (DiLoCo); "" where they do not
    local: str = ""
    # Why a replica cannot be split into pipeline stages (parallel.stages); "" where it can
    no_stages: str = ""

    @property
    def stages(self) -> bool:
        return not self.no_stages


# Shards that apply what comes as it comes would reach a sync point at one stage's push and not its neighbour's
PS_STAGES = "pipeline stages would each leave the shards' sync points at another push"

# A meeting averages a whole replica's weights; one over each stage's share alone is not built
LOCAL_STAGES = "average whole replicas' weights when they meet; a stage's share alone is not built"

REGISTRY: dict[str, Traits] = {
    "allreduce": Traits(uses_ps=False, resizable=True, reforms=True, heals=True),
    "async-allreduce": Traits(uses_ps=False, resizable=True, rounds=True, reforms=True,
                              no_stages="step ahead of their gradients' rounds, which a pipeline's stages would "
                                        "each do by a different count"),
    "local-sgd": Traits(uses_ps=False, local="average", reforms=True, heals=True, no_stages=LOCAL_STAGES),
    "diloco": Traits(uses_ps=False, local="outer", reforms=True, heals=True, no_stages=LOCAL_STAGES),
    "sync": Traits(uses_ps=True, server="sync", reforms=True),
    "backup": Traits(uses_ps=True, server="sync", backups=True, survives_loss=True,
                     no_stages="would each drop another node's gradient as the late one"),
    "mixed-async": Traits(uses_ps=True, server="async", survives_loss=True, no_stages=PS_STAGES),
    "async": Traits(uses_ps=True, server="async", per_node=False, survives_loss=True, no_stages=PS_STAGES),
}


def entry(cfg) -> Traits:
    """The traits of cfg's strategy (strategy.name)."""
    return REGISTRY[cfg.strategy.name]


def pushers(cfg, plan, stage: int = 0) -> list[int]:
    """Ranks that talk to the parameter servers: node leaders, or every replica; with pipeline stages,
    those of one stage (a stage's shards hold its parameters alone)."""
    ranks = list(plan.leaders) if entry(cfg).per_node else [p.rank for p in plan.workers]
    return [r for r in ranks if plan.procs[r].stage == stage]


def stage_shards(cfg, stage: int) -> list[int]:
    """The PS shards that hold a pipeline stage's parameters: shard k holds stage k mod parallel.stages's."""
    return [k for k in range(cfg.cluster.num_ps) if k % cfg.parallel.stages == stage]


def replicas_per_node(cfg) -> int:
    """Model replicas a worker node holds: its processes over the stages of one replica (parallel.stages)."""
    return cfg.cluster.gpus_per_node // cfg.parallel.stages


def replica_images(cfg) -> int:
    """Images behind one replica's gradient: data.batch_size, times the micro-batches it accumulates
    (train.grad_accum_steps)."""
    return cfg.data.batch_size * cfg.train.grad_accum_steps


def push_images(cfg) -> int:
    """Images behind one push: a node's replicas' gradients, or one replica's."""
    return replica_images(cfg) * (replicas_per_node(cfg) if entry(cfg).per_node else 1)


def images_per_update(cfg) -> int:
    """Images whose gradients one update applies: the global batch (all-reduce, sync),
    N-b nodes' batches (backup), one push (asynchronous modes); a replica's batch is its
    accumulated micro-batches' (replica_images). The learning-rate scaling rule
    (optim.scale_lr) is in this unit, on the PS and in all-reduce alike. Local steps count the
    global batch too: a meeting's mean of the replicas' steps moves the weights as all-reduce's
    steps at that batch would (Lin et al. 2020 scale local SGD's rate so); with plain SGD, whose step
    is linear in the gradient, local-sgd meeting every step is all-reduce."""
    e, c = entry(cfg), cfg.cluster
    if cfg.strategy.emulate_workers:  # one process: a gradient of one batch, or a round of K (emulate.py)
        return replica_images(cfg) * (cfg.strategy.emulate_workers if e.rounds else 1)
    if not e.uses_ps:
        return c.nodes * replicas_per_node(cfg) * replica_images(cfg)
    return push_images(cfg) * (wait_for(cfg, c.nodes if e.per_node else c.nodes * replicas_per_node(cfg))
                               if e.server == "sync" else 1)


def wait_for(cfg, pushers: int) -> int:
    """Gradients a synchronous shard needs per version: all, less the backups."""
    return pushers - (cfg.strategy.backup_workers if entry(cfg).backups else 0)


def tolerant(cfg) -> bool:
    """Whether the job goes on without a lost worker node (then no collective joins the workers
    but the ring of a re-forming all-reduce: sync points meet at the shards, see ps/server.py, or in
    the ring, comm/ring.py)."""
    e = entry(cfg)
    return (e.survives_loss or e.reforms and cfg.cluster.survive_loss) and not cfg.strategy.emulate_workers


def lost_with(plan, rank: int) -> list[int]:
    """`rank` and the workers lost with it: a worker's node's, which average and broadcast with it every
    step; a PS shard alone (another takes it on)."""
    if plan.procs[rank].role == "ps":
        return [rank]
    node = plan.procs[rank].node
    return sorted({rank} | {p.rank for p in plan.workers if p.node == node})


def survivable(cfg, plan, lost) -> bool:
    """Whether the job trains on without the processes `lost` (ranks): workers, never the chief's
    node (it evaluates, checkpoints and serves the rendezvous), and under backup at most
    strategy.backup_workers nodes (each update still gets its N-b node gradients); PS shards with
    cluster.survive_loss while one is left to take them on (ps_client.py)."""
    if not lost or not tolerant(cfg):
        return False
    shards = {r for r in lost if plan.procs[r].role == "ps"}
    if shards and not (cfg.cluster.survive_loss and len(shards) < len(plan.ps)):
        return False
    workers = set(lost) - shards
    if not workers:
        return True
    nodes = {plan.procs[r].node for r in workers}
    if plan.workers[0].node in nodes:
        return False
    return not entry(cfg).backups or len(nodes) <= cfg.strategy.backup_workers
