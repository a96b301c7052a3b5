"""Asynchronous all-reduce: replicas never wait for communication.

Each replica adds every gradient it computes into a local sum and goes on
computing. In the background one all-reduce at a time (a round) sums the
replicas' sums and their counts. When a replica sees at a step that the
round has completed, it applies the round's mean (every gradient of every
replica since the previous round, weighted alike) through its optimizer,
and starts the next round with what it summed meanwhile. Every replica
applies the same rounds in the same order to the same values, so all stay
identical; they only apply them at different moments of their own steps.

The number of gradients an update averages and their staleness (updates
applied between the values a gradient was computed on and its own update)
follow from compute against communication: with communication as fast as a
step, every update averages one gradient per replica, one update stale.
strategy.async_bound = K makes a replica wait for the round in flight once
it has computed K gradients since the round started (K = 1: every update
averages one gradient per replica, exactly one update stale).

A round also carries whether any replica holds a request (a stop signal, a
timed checkpoint): its update is then a sync point, and no round starts
until every replica has met there. Gradients summed but not yet sent at a
checkpoint are not in it: a resumed run starts with empty sums.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._utils import _unflatten_dense_tensors

from ..stats import HIST_BINS
from .base import Strategy, Tick
from .traits import replica_images


class AsyncAllReduce(Strategy):
    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.world = len(self.ctx.plan.workers)
        self.version = 0      # updates applied
        self.summed: list[int] = []    # the versions the gradients in the local sum were computed on
        self.sending: list[int] = []   # those of the round in flight
        self.round = None     # the in-flight all-reduce (its work, comm/p2p.py)
        self.stale_hist = torch.zeros(HIST_BINS, dtype=torch.long)   # this replica's gradients, by staleness
        self.update_hist = torch.zeros(HIST_BINS, dtype=torch.long)  # the job's updates, by gradients averaged

    def step(self, lr: float) -> Tick:
        grads = self.grads()
        total = self.buffer("sum", self.numel, grads[0].dtype, grads[0].device)
        if self.round is None and self.summed:  # summed before a sync point, where no round starts
            self._start_round(total)
        flat = self.buffer("flat", self.numel, total.dtype, total.device) if self.summed else total
        torch.cat([g.reshape(-1) for g in grads], out=flat)  # the first since the last round goes in as is
        if flat is not total:
            total.add_(flat)
        self.summed.append(self.version)
        self.counters.steps += 1
        if self.ctx.workers_group is None:  # one replica: nothing to wait for
            self.summed = []
            return self._apply(total, 1, asked=None, lr=lr)
        tick = Tick(self.images, False, False)
        bound = self.cfg.strategy.async_bound
        if self.round is not None and (self.round.is_completed() or (bound and len(self.summed) >= bound)):
            tick = self._finish_round(lr)
        if self.round is None and not tick.synced:
            self._start_round(total)
        return tick

    def _start_round(self, total: torch.Tensor) -> None:
        """Send the local sum, its count and whether this replica holds a request."""
        out = self.buffer("round", self.numel + 2, total.dtype, total.device)
        out[:self.numel].copy_(total)
        out[self.numel] = len(self.summed)
        out[self.numel + 1] = float(bool(self.ctx.requests))
        self.sending, self.summed = self.summed, []
        moved = int(2 * (self.world - 1) / self.world * out.numel() * out.element_size())
        self.counters.bytes_sent += moved
        self.counters.bytes_recv += moved
        self.round = dist.all_reduce(out, group=self.ctx.workers_group, async_op=True)

    def _finish_round(self, lr: float) -> Tick:
        with self.counters.timed("comm_s"):
            self.round.wait()  # NCCL: the stream waits for the round (the events count it); gloo: the host
        self.round = None
        out = self._buffers["round"]
        count = int(out[self.numel].item())
        for v in self.sending:
            self.stale_hist[min(self.version - v, HIST_BINS - 1)] += 1
        self.sending = []
        return self._apply(out[:self.numel], count, asked=bool(out[self.numel + 1].item()), lr=lr)

    def _apply(self, total: torch.Tensor, count: int, asked: bool | None, lr: float) -> Tick:
        """The mean of `count` gradients summed in `total`, through the optimizer; the job's progress."""
        mean = torch.div(total, count, out=self.buffer("mean", self.numel, total.dtype, total.device))
        grads = self.grads()
        for g, v in zip(grads, _unflatten_dense_tensors(mean, grads)):
            g.copy_(v)
        self.set_lr(lr)
        self.optimizer.step()
        self.version += 1
        self.update_hist[min(count, HIST_BINS - 1)] += 1
        return self.advance(count * replica_images(self.cfg), asked)

    def finish(self, stopped: int = 0) -> None:
        if self.round is not None:  # never left in flight: the others would wait in it
            self.round.wait()
            self.round = None

    def figures(self) -> dict:
        return {"hist": self.stale_hist, "update_hist": self.update_hist}
