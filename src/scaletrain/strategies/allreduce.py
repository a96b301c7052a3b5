"""All-reduce: no parameter server; replicas average gradients and step identical optimizers."""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch._utils import _unflatten_dense_tensors

from .base import Strategy, Tick


def average_(tensors: list[torch.Tensor], group, size: int, counters=None, what: str = "comm_s",
             out: torch.Tensor | None = None, wire: torch.Tensor | None = None) -> None:
    """All-reduce the tensors (gradients, or BatchNorm statistics) of `group` into their mean, in place.

    One flat buffer (`out` when given, kept across steps: see Strategy.buffer): one
    collective per step instead of one per tensor. With `wire` (a buffer of the flat
    size in a half type, strategy.compression) the values are divided by the group's
    size first, then summed in that type: half the bytes. Bytes are counted, when
    counters are given, as a ring all-reduce moves them: 2(n-1)/n of the buffer sent
    and received by each process.
    """
    flat = torch.cat([t.reshape(-1) for t in tensors], out=out)
    moving = flat if wire is None else wire.copy_(flat.div_(size))
    with counters.timed(what) if counters else nullcontext():
        dist.all_reduce(moving, group=group)  # collective; blocks until every member joins
    if wire is None:
        flat /= size
    else:
        flat.copy_(wire)
    if counters:
        moved = int(2 * (size - 1) / size * moving.numel() * moving.element_size())
        if what == "intra_s":
            counters.intra_bytes += moved
        else:
            counters.bytes_sent += moved
            counters.bytes_recv += moved
    for t, v in zip(tensors, _unflatten_dense_tensors(flat, tensors)):
        t.copy_(v)


class AllReduce(Strategy):
    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.world = len(self.ctx.plan.workers)

    def step(self, lr: float) -> Tick:
        asked = None
        if self.ctx.workers_group is not None:
            # One more element in the step's all-reduce: whether any replica holds a request (a stop
            # signal, a timed checkpoint), so all of them make this step an agreed point.
            flag = torch.full((1,), float(bool(self.ctx.requests)), device=self.params[0].device)
            grads = self.grads() + [flag]
            average_(grads, self.ctx.workers_group, self.world, self.counters, "comm_s",
                     self.buffer("grads", self.numel + 1, flag.dtype, flag.device),
                     self.wire and self.buffer("wire", self.numel + 1, self.wire, flag.device))
            asked = bool(flag.item())  # host-device sync on GPU
        self.set_lr(lr)
        self.optimizer.step()
        self.counters.steps += 1
        return self.advance(self.schedule.step_images, asked)
