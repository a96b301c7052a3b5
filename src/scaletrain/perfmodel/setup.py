"""What the model needs to know of one configuration, derived from a Config.

The strategy's behaviour comes from the registry entry (parameter servers or
not, sync or async shards, per-node or per-replica pushes, backups), so this
module never looks at a strategy's name. Placement comes from plan.py, the
same placement the launchers use.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import Config
from ..errors import ModelError, ModelNameError, PlanError
from .. import pipeline
from ..models import build_model
from ..plan import make_plan
from ..ps.sharding import make_layout
from ..strategies import entry, wait_for
from .profile import Profile


@dataclass(frozen=True)
class Setup:
    nodes: int                   # worker nodes
    nodes_total: int             # worker nodes + dedicated PS nodes
    replicas: int                # replicas per worker node
    uses_ps: bool
    sync: bool                   # shards wait for a version's gradients (sync, backup)
    per_node: bool               # one pusher per node (averaged inside) or one per replica
    wait_for: int                # gradients a sync shard applies per version
    shard_bytes: tuple[int, ...]
    ps_nodes: tuple[int, ...]    # node of each PS
    slow_node: int               # node whose replicas are slowed (-1: none)
    slow_delay_s: float
    loaders: int                 # background loader processes per replica (0: the training process loads)
    rounds: bool = False         # async-allreduce: all-reduce rounds in the background
    sync_every: int = 1          # local-sgd, diloco: steps between the replicas' meetings (strategy.sync_every)
    outer: bool = False          # diloco: an outer optimizer's step at each meeting
    stages: int = 1              # pipeline stages of a replica (parallel.stages), one device each
    microbatches: int = 1        # parallel.microbatches
    held: int = 1                # micro-batches whose activations a stage holds at most (GPipe: all; 1F1B: S)
    boundary_bytes: float = 0.0  # bytes of activations one image sends across the widest split point

    @property
    def pushers(self) -> int:
        return self.nodes if self.per_node else self.nodes * self.replicas

    def pusher_node(self, i: int) -> int:
        return i if self.per_node else i // self.replicas

    @property
    def pusher_replicas(self) -> int:
        """Replicas whose images one push carries."""
        return self.replicas if self.per_node else 1


def shard_bytes(cfg: Config, total: int) -> tuple[int, ...]:
    """Bytes of each PS shard, split as the run would split them."""
    p = cfg.cluster.num_ps
    if cfg.cluster.sharding == "balanced":
        return tuple(total // p + (1 if k < total % p else 0) for k in range(p))
    numels = param_numels(cfg.model)
    layout = make_layout(numels, p, "round-robin")
    scale = total / (4 * sum(numels))  # the profile's gradient size rules
    return tuple(int(layout.bytes(k) * scale) for k in range(p))


def param_numels(model_cfg) -> list[int]:
    """Element count of each parameter of the network a ModelConfig builds (built-in or by import
    path: build_model, the job's own), in model order: the gradient the job moves."""
    try:
        with torch.device("meta"):  # sizes only: no memory, no initialisation cost
            model = build_model(model_cfg, weights=False)
    except ModelNameError:  # a factory that reads values as it builds cannot run on meta tensors: for real
        model = build_model(model_cfg, weights=False)
    return [q.numel() for q in model.parameters()]


def boundary_bytes(cfg: Config) -> float:
    """Bytes of activations one image sends across the widest of the split points that balance the
    network's parameters over parallel.stages (parallel.split's where it names them): the layers'
    output shapes from a forward on the meta device (no memory, no compute), in fp32, or bf16 at
    train.precision = bf16 (on a GPU)."""
    _, _, starts, mods = pipeline.meta_split(cfg)
    h, sizes = torch.empty(1, 3, cfg.data.image_size, cfg.data.image_size, device="meta"), []
    for m in mods:
        h = m(h)
        sizes.append(h.numel())
    return max(sizes[i - 1] for i in starts[1:]) * (2 if cfg.train.precision == "bf16" else 4)


def make_setup(cfg: Config, prof: Profile) -> Setup:
    c, s = cfg.cluster, cfg.strategy
    if s.emulate_workers:
        raise ModelError("strategy.emulate_workers: an emulation in one process, not a cluster to predict")
    if s.compression != "none":
        raise ModelError(f"strategy.compression = {s.compression}: the model's costs are of fp32 transfers; "
                         "predict with strategy.compression = none")
    if c.gpus_per_node > prof.replicas_per_node:
        raise ModelError(f"cluster.gpus_per_node = {c.gpus_per_node}: the profile's nodes offer "
                         f"{prof.replicas_per_node} replicas")
    par = cfg.parallel
    if par.stages > 1 and entry(cfg).uses_ps:
        raise ModelError(f"parallel.stages = {par.stages}: the model has stages under allreduce only, not with the "
                         f"parameter servers of strategy.name = {cfg.strategy.name!r}")
    e = entry(cfg)
    try:
        plan = make_plan(c, e.uses_ps, stages=cfg.parallel.stages)
    except PlanError as err:
        raise ModelError(str(err)) from None
    pushers = c.nodes if e.per_node else c.nodes * c.gpus_per_node
    staged = {} if par.stages == 1 else dict(
        stages=par.stages, microbatches=par.microbatches,
        held=par.microbatches if par.schedule == "gpipe" else min(par.microbatches, par.stages),
        boundary_bytes=boundary_bytes(cfg))
    return Setup(nodes=c.nodes, nodes_total=plan.nodes_total, replicas=c.gpus_per_node // par.stages, uses_ps=e.uses_ps,
                 sync=e.server == "sync", per_node=e.per_node,
                 wait_for=wait_for(cfg, pushers) if e.uses_ps else 0,
                 shard_bytes=shard_bytes(cfg, prof.gradient_bytes) if e.uses_ps else (),
                 ps_nodes=tuple(p.node for p in plan.ps), slow_node=s.slow_node, slow_delay_s=s.slow_delay_s,
                 loaders=cfg.data.workers, rounds=e.rounds, sync_every=s.sync_every if e.local else 1,
                 outer=e.local == "outer", **staged)


def check_workload(cfg: Config, prof: Profile, path: str) -> None:
    """The recipe must train what the profile's compute figures were measured for: the same
    network (model.name and model.args) at the same image size. Its batch per replica may differ
    (profile.at_batch)."""
    have = (cfg.model.name, cfg.model.args, cfg.data.image_size)
    want = (prof.model, prof.model_args, prof.image_size)
    if have != want:
        def says(name, args, size):
            return f"{name}{f' {args}' if args else ''}, {size} px"
        raise ModelError(f"profile {path} was measured for {says(*want)}; the recipe "
                         f"trains {says(*have)} (run `scaletrain calibrate` with it)")
