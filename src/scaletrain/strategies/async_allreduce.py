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

With cluster.survive_loss the rounds go over a Ring (comm/ring.py), which
re-forms without a lost node, one round at a time on a thread of the
strategy's own (the ring's collectives wait): a round carries two request
values (checkpoint, stop). A member one round behind when the ring re-forms
takes the front's result of that round, whole, which held its own sum: every
replica still applies the same rounds. After a loss a round averages the
survivors' gradients (its count says how many); the lost replica's gradients
summed since its last round are lost. Replacements are not taken in.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist
from torch._utils import _unflatten_dense_tensors

from ..comm.liveness import CHECKPOINT, STOP
from ..comm.ring import Finished, Ring
from ..stats import HIST_BINS
from .base import Strategy, Tick
from .traits import replica_images


class _Round:
    """A round over the ring, run on the strategy's thread: the work's interface (is_completed, wait)."""

    def __init__(self, future) -> None:
        self.future = future

    def is_completed(self) -> bool:
        return self.future.done()

    def wait(self) -> None:
        self.future.result()  # raises Finished where the front ended the job meanwhile


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
        self.ring = self.pool = None
        if self.ctx.tolerant and self.ctx.workers_group is not None:
            # Nothing to send a member behind but the round's result (allreduce's small part: all of it)
            self.ring = Ring(self.ctx, dict, lambda state: None)
            self.pool = ThreadPoolExecutor(1, thread_name_prefix="ring")  # the ring's collectives, in order

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
        # Over the ring, a host buffer (gloo, pinned beside a GPU): the round's thread copies nothing to a device
        dev = total.device if self.ring is None else torch.device("cpu")
        out = self.buffer("round", self.numel + 3, total.dtype, dev, pin=dev != total.device)
        out[:self.numel].copy_(total)
        out[self.numel] = len(self.summed)
        r = self.ctx.requests
        out[self.numel + 1:] = torch.tensor([float(bool(r & CHECKPOINT)), float(bool(r & STOP))])
        self.sending, self.summed = self.summed, []
        n = self.ring.size if self.ring is not None else self.world
        moved = int(2 * (n - 1) / n * out.numel() * out.element_size())
        self.counters.bytes_sent += moved
        self.counters.bytes_recv += moved
        if self.ring is not None:  # the host's tensor: gloo's, as the group's below
            self.round = _Round(self.pool.submit(self.ring.allreduce, out, out.numel()))
        else:
            self.round = dist.all_reduce(out, group=self.ctx.workers_group, async_op=True)

    def _finish_round(self, lr: float) -> Tick:
        try:
            with self.counters.timed("comm_s"):
                self.round.wait()  # NCCL: the stream waits for the round (the events count it); gloo: the host
        except Finished:  # (the ring) the others reached the job's target a round ahead: this replica ends too
            self.round = None
            return Tick(self.images, True, True)
        self.round = None
        out = self._buffers["round"]
        count = int(out[self.numel].item())
        for v in self.sending:
            self.stale_hist[min(self.version - v, HIST_BINS - 1)] += 1
        self.sending = []
        asked = (CHECKPOINT if out[self.numel + 1] > 0 else 0) | (STOP if out[self.numel + 2] > 0 else 0)
        tick = self._apply(out[:self.numel], count, asked=bool(asked), lr=lr)
        return Tick(tick.images, tick.synced, tick.stop, asked)

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

    def agree_stop(self, stop: bool) -> bool:
        """Over the ring (no round is in flight at a sync point): whether the chief, which evaluated alone, stops."""
        if self.ring is None:
            return stop
        t = torch.tensor([float(stop)])
        try:
            self.pool.submit(self.ring.allreduce, t, 1, dist.ReduceOp.MAX).result()
        except Finished:
            return True
        return bool(t[0] > 0)

    def healed(self, k: int) -> dict | None:
        """Seconds from this replica seeing the chief's drop to its ring agreeing where its members stand; a
        member behind took the front's round, its own gradients in it, so no step is lost."""
        if self.ring is None:
            return {}
        if set(self.ring.members) & set(self.ctx.dropped):
            return None  # its next round re-forms the ring
        if not self.ring.losses:
            return {}
        return {"heal_s": round(self.ring.losses[min(k, len(self.ring.losses) - 1)]["healed_s"], 3)}

    def finish(self, stopped: int = 0) -> None:
        if self.round is not None:  # never left in flight: the others would wait in it
            try:
                self.round.wait()
            except Finished:
                pass
            self.round = None
        if self.pool is not None:
            self.pool.shutdown()

    def figures(self) -> dict:
        return {"hist": self.stale_hist, "update_hist": self.update_hist}
