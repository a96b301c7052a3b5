"""The one interface every synchronisation strategy implements.

A strategy wraps the replica's model and optimizer. The train loop runs
forward and backward, then calls `step(lr)`; when it returns, the replica's
parameters hold the values to compute the next batch on, and the Tick says
how far the job has come (images applied, schedule.py), whether this step is
a sync point (every worker now holds the same values and meets the others;
schedule.py) and whether the job's target is reached. The loop never asks
which strategy it runs.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from ..comm.groups import Context
from ..metrics import DeviceTimer
from ..noise import NoiseScale
from ..ps.protocol import WIRE
from ..schedule import Schedule


@dataclass(frozen=True)
class Tick:
    images: int   # images the job has applied so far, as this process knows it
    synced: bool  # a sync point: every worker holds the same values now
    stop: bool    # the job's target is reached
    asked: int = 0  # at a sync point the shards made (PS): the requests it was asked with (liveness.CHECKPOINT, STOP)


class Counters:
    """Traffic and time, counted where this process calls send/recv/collectives.

    The times are read from DeviceTimers: on a GPU an NCCL collective returns once it is queued,
    and what it waits for shows on the device's stream (the events), not on the host's clock."""

    def __init__(self, device: torch.device = torch.device("cpu")) -> None:
        self.bytes_sent = 0   # between nodes: to the PS, or this process's share of an all-reduce
        self.bytes_recv = 0
        self.intra_bytes = 0  # sent inside the node (gradient averaging, parameter broadcast)
        self.steps = 0
        # intra_s: averaging inside the node; comm_s: all-reduce between nodes, or push/pull waiting on the PS
        self.clocks = {"intra_s": DeviceTimer(device), "comm_s": DeviceTimer(device)}

    @property
    def intra_s(self) -> float:
        return self.clocks["intra_s"].seconds()  # on a GPU a host-device sync: read at log points only

    @property
    def comm_s(self) -> float:
        return self.clocks["comm_s"].seconds()  # on a GPU a host-device sync: read at log points only

    def timed(self, what: str):
        """Context in which the work started (on a GPU, queued) counts towards `what`."""
        return self.clocks[what].timing()


class Strategy:
    pusher = True  # whether this process talks to other nodes itself (PS: only node leaders do)
    ddp = None  # the DistributedDataParallel wrap() returned, where backward averages over a group
    lr_scale = 1.0  # the rate applied over the schedule's: a re-formed ring's smaller batch (allreduce.py)

    def __init__(self, cfg, ctx: Context, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 schedule: Schedule) -> None:
        self.cfg, self.ctx, self.model, self.optimizer, self.schedule = cfg, ctx, model, optimizer, schedule
        self.params = [p for p in model.parameters()]
        self.numel = sum(p.numel() for p in self.params)  # parameters (and gradients) end to end
        self._buffers: dict[str, torch.Tensor] = {}
        self.counters = Counters(self.params[0].device)
        self.images = 0  # where every replica applies every update: the job's progress
        # The micro-batches of this replica's next update: train.grad_accum_steps, or more where the replicas
        # left keep the global batch (cluster.after_loss = keep-batch, allreduce.py); job.py reads it
        self.accum = cfg.train.grad_accum_steps
        self.members = ctx.plan.replicas  # the replicas an update averages now (fewer after a loss: allreduce.py)
        self.wire = WIRE[cfg.strategy.compression]  # the type gradients and values travel in between nodes
        # The gradient noise scale's sums, where backward averages over a group of replicas (noise.py)
        self.noise: NoiseScale | None = None

    def wrap(self) -> torch.nn.Module:
        """The module a replica's forward and backward run through: the model itself, or a wrapper
        that communicates while backward runs (allreduce: DistributedDataParallel)."""
        return self.model

    def step(self, lr: float) -> Tick:
        raise NotImplementedError

    def sync_backward(self, on: bool) -> None:
        """Whether the next forward's backward through wrap()'s module averages over its group. Off for
        all but the last micro-batch of an accumulated update (train.grad_accum_steps): their gradients
        add up in .grad (DDP's buckets) and the last backward all-reduces the sum, once an update, not
        once a micro-batch. Set before the forward, as DDP's no_sync() sets it."""
        if self.ddp is not None:
            self.ddp.require_backward_grad_sync = on

    def advance(self, images: int, asked: bool | None = None) -> Tick:
        """Progress of a strategy whose replicas all apply every update (all-reduce, one process).
        asked: whether any replica holds a request (liveness.CHECKPOINT, STOP), which makes this step a
        sync point; None means this process's own requests (one process)."""
        asked = bool(self.ctx.requests) if asked is None else asked
        before, self.images = self.images, self.images + images
        return Tick(self.images, asked or self.images >= self.schedule.next_point(before),
                    self.images >= self.schedule.target)

    def finish(self, stopped: int = 0) -> None:
        """Called once after the last step (e.g. to release the PS); stopped: the number of the
        signal that stopped the job before its end (-1 when unknown), 0 when it ran to its end."""

    def agree_stop(self, stop: bool) -> bool:
        """At a sync point where this worker decided alone whether the job stops (only the chief
        evaluates where no collective joins the workers): what its replicas that must stop with it
        decide. Here there are none."""
        return stop

    def healed(self, k: int) -> dict | None:
        """How the replicas went on after the chief's k-th drop of lost ones (from 0), for summary.json's
        lost_workers: where they re-form a group of their own (comm/ring.py), "steps_lost" (this worker's
        steps whose gradient no update applied: 0 or 1) and "heal_s" (seconds from this worker seeing the
        drop to its new group agreeing where its members stand); None until they did. Here nothing is
        re-formed."""
        return {}

    def joined(self, final: bool = False) -> list[dict]:
        """The replacements admitted so far (the chief; comm/ring.py), each {"ranks", "t" (perf_counter),
        "pause_s" (the survivors' pause to admit and send the state)}; with final, also what each replacement
        measured where it said so: "start_s" (its launch to its request to join), "wait_s" (to its
        admission, at the survivors' next step), "adopt_s" (to the state adopted). Here none join."""
        return []

    def set_stages(self, numels: list[list[int]]) -> None:
        """The parameter sizes of every pipeline stage of the replica (job.py), for a strategy whose state
        outside this process covers every stage's (the PS shards)."""

    def replica_state(self) -> list[torch.Tensor]:
        """Tensors this replica holds apart from the others beyond its BatchNorm statistics (its own
        optimizer state, where replicas step alone: local.py), saved per replica in checkpoints."""
        return []

    def snapshot(self) -> dict:
        """State held outside this process, for the chief's checkpoint (called between steps)."""
        return {}

    def restore(self, state: dict) -> None:
        """Continue from a checkpoint's state (every worker calls it, after loading the model)."""
        self.images = state["images"]

    def latest(self):
        """Context in which the model holds the newest values (for evaluation and checkpoints)."""
        return nullcontext()

    def stats(self) -> dict:
        """Figures for a single-process summary (distributed runs gather theirs)."""
        return {}

    def figures(self) -> dict:
        """This process's histograms for the job's summary (stats.pack): "hist", the staleness
        of the gradients it applied, and "update_hist", the gradients each update averaged."""
        return {}

    def set_lr(self, lr: float) -> None:
        for g in self.optimizer.param_groups:
            g["lr"] = lr

    def buffer(self, name: str, numel: int, dtype: torch.dtype, device: torch.device, pin: bool = False) -> torch.Tensor:
        """A flat tensor of `numel` elements kept for the next step's same use (`name`). A fresh
        one every step costs its first-touch page faults, a fault per 4 KB page: for a gradient of
        tens of MB, more than moving it through loopback. pin: in page-locked host memory, which a
        GPU copies to and from without a staging copy and without blocking the host."""
        buf = self._buffers.get(name)
        if buf is None or buf.numel() != numel or buf.dtype != dtype or buf.device != device:
            buf = self._buffers[name] = torch.empty(numel, dtype=dtype, device=device, pin_memory=pin)
        return buf

    def grads(self) -> list[torch.Tensor]:
        """Every parameter's gradient, zeros where backward left none, so all
        replicas communicate buffers of the same layout."""
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        return [p.grad for p in self.params]
