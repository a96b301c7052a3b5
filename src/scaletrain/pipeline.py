"""Pipeline stages: one replica's network split over `parallel.stages` processes of a node.

A replica's S processes each hold a contiguous run of the network's layers (its stage). A batch
is cut into `parallel.microbatches` micro-batches; stage s computes micro-batch m's forward once
stage s-1 has sent it the activations, and its backward once stage s+1 has sent their gradient.
The schedule (GPipe: every forward, then every backward; 1F1B: one of each in turn, so a stage
holds the activations of at most S micro-batches) and the sends are torch.distributed.pipelining's
(PipelineStage, ScheduleGPipe, Schedule1F1B), over the replica's own group (Context.pipe_group).
A stage's gradients are averaged with the same stage of the other replicas by the strategy, as a
whole replica's are without stages (Context.workers_group is the stage's group).

Split points balance the layers' measured forward and backward time (or their parameter counts),
chosen alike by every process: each measures its layers on its own device, one layer at a time
(a network too large for one device still fits layer by layer), and the times are averaged over
the job's workers. `parallel.split` names them instead.

A network is split at its layers: a torch.nn.Sequential's children, or the (name, module) pairs
its `pipeline_layers()` returns, applied in that order (the built-in ResNets have one). Every
process builds the whole network and keeps the layers of other stages on the host, so that the
chief can write one logical model (its checkpoints, model.safetensors): `gather` brings every
stage's values into it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from .compute import autocast, grads_to_none
from .errors import ConfigError, RunError
from .metrics import DeviceTimer, sync
from .optim import loss_decay
from .pipeline_split import (balance, layers, merge_in_place, meta_split, named_starts,  # noqa: F401 - theirs
                             planned_split, stage_module)
from .ps.protocol import TAG_SPLIT


def p2p_pairs(ranks: list[int], replica: int) -> list[tuple[int, int]]:
    """(sender, receiver) of every single send and receive a replica's stages (`ranks`, stage order) make
    after start-up, in the order each process warms them: evaluation's activations, each stage to the
    next (every replica; the schedule's first step sends single messages on these pairs too, the vote
    of torch.distributed.pipelining's stages); the checkpoint's gather, every later stage to the first
    (replica 0 only). A pair's communicator serves both directions.
    Ordered by the pair's ranks, so that each pair's two processes meet at it: the first pair left is
    the next of both its processes."""
    pairs = [(ranks[s], ranks[s + 1]) for s in range(len(ranks) - 1)]
    if replica == 0:
        pairs += [(ranks[k], ranks[0]) for k in range(2, len(ranks))]
    return sorted(pairs, key=lambda p: (min(p), max(p)))


def backend_refused(device_type: str, backend: str) -> str | None:
    """Why a replica's stages on `device_type` cannot talk over `backend`, or None: gloo sends no GPU tensor
    from one process to another, which the schedules' activations are."""
    if device_type == "cuda" and backend != "nccl":
        return ("parallel.stages on GPUs needs NCCL between them, not cluster.backend = 'gloo' (its point-to-point "
                "sends take no GPU tensors): set cluster.backend = 'auto', a GPU a process")
    return None


@dataclass
class Profile:
    """What each layer costs, measured on one micro-batch."""
    seconds: list[float]  # forward and backward, each layer
    params: list[int]
    shapes: list[tuple[int, ...]]  # each layer's output, less the batch dimension
    dtypes: list[torch.dtype]
    in_shape: tuple[int, ...]
    in_dtype: torch.dtype
    out_bytes: list[int]  # bytes of a layer's output for one micro-batch


def measure(mods: list[nn.Module], x: torch.Tensor, device: torch.device, precision: str, timed: bool) -> Profile:
    """Each layer's output shape and, when `timed`, its forward and backward time on `device`, one layer at
    a time (each goes back where it was). The job's random state and the layers' buffers (BatchNorm's
    running statistics) are left as they were: a measured run trains as an unmeasured one."""
    seconds, shapes, dtypes, out_bytes = [], [], [], []
    in_shape, in_dtype = tuple(x.shape[1:]), x.dtype
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        h = x.to(device)
        for m in mods:
            home = next(m.parameters(), torch.empty(0)).device
            saved = {k: b.clone() for k, b in m.named_buffers()}
            m.to(device)
            t = 0.0
            for run in range(2 if timed else 1):  # the first warms kernels and the allocator up
                inp = h.detach().requires_grad_(h.is_floating_point() and timed)
                sync(device)
                t0 = time.perf_counter()
                with autocast(precision, device), torch.set_grad_enabled(timed):
                    out = m(inp)
                if timed:
                    out.float().sum().backward()
                sync(device)  # host-device sync: the clock must see the layer's kernels
                t = time.perf_counter() - t0
            seconds.append(t)
            shapes.append(tuple(out.shape[1:]))
            dtypes.append(out.dtype)
            out_bytes.append(out.numel() * out.element_size())
            with torch.no_grad():
                for k, b in m.named_buffers():
                    b.copy_(saved[k])
            for p in m.parameters():
                p.grad = None
            m.to(home)
            h = out.detach()
    params = [sum(p.numel() for p in m.parameters()) for m in mods]
    return Profile(seconds, params, shapes, dtypes, in_shape, in_dtype, out_bytes)


class Stages(nn.Module):
    """What job.wrap returns where a replica is split into stages: its forward and backward are the
    pipeline schedule's (job.forward_backward), not a call of a module."""

    def __init__(self, stage: nn.Module) -> None:
        super().__init__()
        self.stage = stage

    def forward(self, *args, **kwargs):
        raise RunError("with parallel.stages > 1 a batch's forward and backward are the pipeline schedule's: "
                       "write loss = job.forward_backward(x, y) instead of calling the model and loss.backward()")


class Pipeline:
    """This process's stage of its replica: the split, the schedule, and what crosses between stages."""

    def __init__(self, cfg, ctx, model: nn.Module, device: torch.device, split: list[str] | None = None) -> None:
        """split: the first layers of stages 2, 3, ... (a resumed run's, its checkpoint's); None: parallel.split,
        or measured."""
        p, plan, me = cfg.parallel, ctx.plan, ctx.me
        self.cfg, self.ctx, self.model, self.device = cfg, ctx, model, device
        self.S, self.stage, self.M = plan.stages, me.stage, p.microbatches
        self.ranks, self.group = plan.pipeline_of(me), ctx.pipe_group
        refused = backend_refused(device.type, dist.get_backend(self.group))
        if refused:
            raise ConfigError(refused)
        named = merge_in_place(layers(model))
        self.names, mods = [n for n, _ in named], [m for _, m in named]
        micro = cfg.data.batch_size // self.M
        sample = torch.zeros(micro, 3, cfg.data.image_size, cfg.data.image_size)
        split = split or p.split
        timed = p.balance == "time" and not split
        prof = self.profile = measure(mods, sample, device, cfg.train.precision, timed)
        if timed and ctx.job_group is not None:  # every process splits alike: the mean of every worker's times
            t = torch.tensor(prof.seconds, dtype=torch.float64)
            dist.all_reduce(t, group=ctx.workers_cpu_group)  # collective over the workers (gloo, host)
            prof.seconds = (t / len(plan.workers)).tolist()
        self.starts = named_starts(self.names, split) if split else \
            balance(prof.seconds if timed else [float(n) for n in prof.params], self.S)
        ends = self.starts[1:] + [len(mods)]
        self.parts = [nn.Sequential(*mods[a:b]) for a, b in zip(self.starts, ends)]
        if ctx.is_chief:  # the shards of a parameter server hold a stage's parameters: they need the split
            for ps in plan.ps:
                dist.send(torch.tensor(self.starts, dtype=torch.int64), dst=ps.rank, tag=TAG_SPLIT)  # point-to-point
        self.module = self.parts[self.stage].to(device)
        lo, hi = self.starts[self.stage], ends[self.stage]
        self.in_shape, self.in_dtype = (prof.in_shape, prof.in_dtype) if lo == 0 else \
            (prof.shapes[lo - 1], prof.dtypes[lo - 1])
        self.out_shape, self.out_dtype = prof.shapes[hi - 1], prof.dtypes[hi - 1]
        self.first, self.last = self.stage == 0, self.stage == self.S - 1
        where = {id(q): i for i, q in enumerate(model.parameters())}
        self.index = [[where[id(q)] for q in part.parameters()] for part in self.parts]  # the full model's numbering
        self.decayed = [q for q in self.module.parameters() if q.ndim > 1]  # optim.decayed, of this stage
        self.schedule = None
        self.sent = 0  # bytes of activations and their gradients this stage sent
        # Seconds this stage computed (its forwards and backwards) and ran schedules: the rest is its idle time,
        # the bubble. DeviceTimers: CUDA events on a GPU, no host-device sync per step.
        self.busy, self.total = DeviceTimer(device), DeviceTimer(device)
        self.warmed = self._warm()

    def _warm(self) -> list[tuple[int, int]]:
        """One element over each pair of p2p_pairs now, at start-up. Under NCCL a single send or receive
        builds its pair's two-rank communicator at its first use: without this, at the first evaluation
        or checkpoint, long after the start-up check of the groups (comm/groups.py), where a pair that
        cannot talk (a NIC, a peer's interface) would fail late. Costs one host-device sync. Returns the
        pairs this process took part in."""
        me, on, done = self.ctx.me.rank, self._host(), []
        for src, dst in p2p_pairs(self.ranks, self.ctx.plan.replica_of(self.ctx.me)):
            if me not in (src, dst):
                continue
            t = torch.ones(1, device=on)
            try:
                if me == src:
                    dist.send(t, dst=dst, group=self.group)  # point-to-point, as evaluation and gather send
                else:
                    dist.recv(t, src=src, group=self.group)
                sync(on)  # host-device sync under NCCL: the pair has really exchanged
            except Exception as e:  # noqa: BLE001 - any failure here is the pair's, said in one line
                plan = self.ctx.plan
                raise RunError(f"the stages of replica {plan.replica_of(self.ctx.me)} could not exchange at start-up "
                               f"between {plan.describe(src)} and {plan.describe(dst)} over "
                               f"{dist.get_backend(self.group)}: {str(e).strip().splitlines()[-1] if str(e) else e!r}"
                               ) from None
            done.append((src, dst))
        return done

    def figures(self) -> dict:
        """This process's pipeline figures for the job's summary (stats.FIELDS)."""
        return {"stage": self.stage, "busy_s": self.busy.seconds(), "pipe_s": self.total.seconds(),
                "act_sent": self.sent}

    def describe(self) -> list[dict]:
        """The split, for the plan and the run's summary: each stage's layers, measured time and parameters."""
        ends = self.starts[1:] + [len(self.names)]
        return [{"stage": k + 1, "first": self.names[a], "last": self.names[b - 1], "layers": b - a,
                 "seconds": sum(self.profile.seconds[a:b]), "parameters": sum(self.profile.params[a:b]),
                 "activation_bytes": self.profile.out_bytes[b - 1] if b < len(self.names) else 0}
                for k, (a, b) in enumerate(zip(self.starts, ends))]

    def build(self, wrapped: nn.Module) -> Stages:
        """The schedule around this stage's module as the strategy wrapped it (a DistributedDataParallel
        over the stage's replicas: the pipeline runs the micro-batches' backwards without its all-reduce
        but the last's)."""
        micro = self.cfg.data.batch_size // self.M
        # Example micro-batches (no memory: the meta device) give the stage its inputs' and outputs' shapes, so
        # that none is inferred at run time. They require gradients: the schedule sends a stage's input
        # gradient back to the stage before only then.
        meta = lambda shape, dtype: torch.empty((micro, *shape), dtype=dtype, device="meta",  # noqa: E731
                                                requires_grad=dtype.is_floating_point)
        stage = PipelineStage(wrapped, self.stage, self.S, self.device, input_args=meta(self.in_shape, self.in_dtype),
                              output_args=meta(self.out_shape, self.out_dtype), group=self.group)
        kind = Schedule1F1B if self.cfg.parallel.schedule == "1f1b" else ScheduleGPipe
        # scale_grads: the micro-batches' gradients are summed, then divided by their count: the batch's mean. y: class
        # indices or soft targets (mixing.py), cut into micro-batches along the batch as x is
        self.schedule = kind(stage, self.M, loss_fn=lambda out, y: nn.functional.cross_entropy(out.float(), y),
                             scale_grads=True)
        self.to_none = grads_to_none(wrapped)
        for name in ("forward_one_chunk", "backward_one_chunk"):  # this stage's compute, as the schedule runs it
            setattr(stage, name, self._busy(getattr(stage, name)))
        return Stages(wrapped)

    def _busy(self, work):
        def timed(*args, **kwargs):
            with self.busy.timing():
                return work(*args, **kwargs)
        return timed

    def __call__(self, batch) -> tuple[torch.Tensor, int]:
        """Forward and backward of a batch through every stage; the batch's loss (the same on every stage,
        weight decay of every stage included) and its images. .grad holds this stage's gradient, averaged
        over the stage's replicas."""
        x, y = batch
        for q in self.module.parameters():
            if q.grad is not None:
                q.grad = None if self.to_none else q.grad.zero_()
        losses: list[torch.Tensor] = []
        with autocast(self.cfg.train.precision, self.device), self.total.timing():
            if self.first:
                self.schedule.step(x)
            elif self.last:
                self.schedule.step(target=y, losses=losses, return_outputs=False)
            else:
                self.schedule.step()
        wd = loss_decay(self.cfg.optim)
        loss = torch.stack(losses).float().mean() if losses else torch.zeros((), device=self.device)
        if wd and self.decayed:  # the loss's 0.5 wd |w|^2 of this stage's weights, and its gradient
            with torch.no_grad():
                for q in self.decayed:
                    q.grad.add_(q, alpha=wd)
            loss = loss + 0.5 * wd * torch.stack(torch._foreach_norm(self.decayed)).pow(2).sum()
        total = loss.detach().reshape(1).to(torch.float32)
        dist.all_reduce(total, group=self.group)  # collective over the replica's stages: the whole loss
        self.sent += self.M * (0 if self.last else _nbytes(x.shape[0] // self.M, self.out_shape, self.out_dtype)) + \
            self.M * (0 if self.first else _nbytes(x.shape[0] // self.M, self.in_shape, self.in_dtype))
        return total[0], len(y)

    @torch.no_grad()
    def forward(self, x: torch.Tensor | None, n: int) -> torch.Tensor | None:
        """Evaluation: the logits of a batch of n images on the last stage (None on the others), the
        activations sent stage to stage, whole (no micro-batches: nothing waits on a backward)."""
        if self.first:
            h = x
        else:
            h = torch.empty((n, *self.in_shape), dtype=self.in_dtype, device=self.device)
            dist.recv(h, src=self.ranks[self.stage - 1], group=self.group)  # point-to-point: the stage before
        with autocast(self.cfg.train.precision, self.device):
            out = self.module(h)
        if self.last:
            return out
        dist.send(out.to(self.out_dtype).contiguous(), dst=self.ranks[self.stage + 1], group=self.group)
        return None

    def _host(self) -> torch.device:
        """Where tensors crossing the stages' group live: the GPU under NCCL, the host under gloo."""
        return self.device if dist.get_backend(self.group) == "nccl" else torch.device("cpu")

    def gather(self, optimizer: torch.optim.Optimizer | None = None, keys: tuple[str, ...] = ()) -> dict | None:
        """Every stage's values into the chief's whole model (replica 0's stages send theirs; the other
        replicas hold the same), and with `optimizer`, its state for the whole model (the chief's return;
        None elsewhere). Point-to-point over the replica's stages."""
        if self.ctx.plan.replica_of(self.ctx.me) != 0:
            return None
        chief, on = self.ranks[0], self._host()
        state = {} if optimizer is not None else None
        for k in range(1, self.S):
            tensors = list(self.parts[k].state_dict().values())
            if optimizer is not None and optimizer.state:
                params = list(self.parts[k].parameters())
                if self.first:
                    extra = [[torch.empty_like(q) for _ in keys] for q in params]
                    tensors += [t for ts in extra for t in ts]
                else:
                    tensors += [optimizer.state[q][key] for q in params for key in keys] if k == self.stage else []
            if self.first:
                for t in tensors:
                    buf = t if t.device == on else torch.empty_like(t, device=on)
                    dist.recv(buf, src=self.ranks[k], group=self.group)  # point-to-point, at checkpoints only
                    if buf is not t:
                        t.copy_(buf)
                if optimizer is not None and optimizer.state:
                    state.update({g: dict(zip(keys, ts)) for g, ts in zip(self.index[k], extra)})
            elif k == self.stage:
                for t in tensors:
                    dist.send(t.to(on).contiguous(), dst=chief, group=self.group)
        if not self.first or state is None:
            return None
        own = optimizer.state_dict()
        state.update({self.index[0][j]: v for j, v in own["state"].items()})
        groups = [{**own["param_groups"][0], "params": list(range(sum(map(len, self.index))))}]
        return {"state": state, "param_groups": groups}

    @property
    def buffer_numel(self) -> int:
        """The largest stage's floating buffers (BatchNorm statistics), in values (at least 1)."""
        return max(1, *(sum(b.numel() for b in part.buffers() if b.is_floating_point()) for part in self.parts))

    def by_stage(self, flats: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        """Every worker's padded buffers (tracker: replica_buffers, in worker order) as [stage][replica],
        each cut to its stage's size: the checkpoint's replica_buffers with stages."""
        plan, out = self.ctx.plan, [[] for _ in range(self.S)]
        sizes = [sum(b.numel() for b in part.buffers() if b.is_floating_point()) for part in self.parts]
        for w, flat in sorted(zip(plan.workers, flats), key=lambda wf: plan.replica_of(wf[0])):
            out[w.stage].append(flat[:sizes[w.stage]] if sizes[w.stage] else flat[:1])
        return out

    @property
    def split(self) -> list[str]:
        """The first layers of stages 2, 3, ...: what parallel.split would say of this split."""
        return [self.names[i] for i in self.starts[1:]]

    def local_optimizer(self, whole: dict) -> dict:
        """This stage's part of a whole model's optimizer state (gather's), to load into its optimizer."""
        mine = self.index[self.stage]
        return {"state": {j: whole["state"][g] for j, g in enumerate(mine) if g in whole["state"]},
                "param_groups": [{**whole["param_groups"][0], "params": list(range(len(mine)))}]}


def _nbytes(n: int, shape: tuple[int, ...], dtype: torch.dtype) -> int:
    size = n
    for s in shape:
        size *= s
    return size * dtype.itemsize
