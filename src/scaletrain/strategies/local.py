"""Local SGD and DiLoCo: replicas step alone and meet every strategy.sync_every steps.

Between meetings a replica applies its own gradient through its own optimizer, whose state stays
its own (Lin et al. 2020, "Don't use large mini-batches, use local SGD"; Douillard et al. 2023,
"DiLoCo"), and nothing crosses the network but the one-element request flag of allreduce.py. At
a meeting the replicas all-reduce one flat tensor of the weights' size:
- local-sgd: their weights; the mean becomes every replica's.
- diloco: their change since the last meeting, anchor - weights, where the anchor is the weights
  of the last meeting. Its mean is the gradient of an outer optimizer, SGD with Nesterov momentum
  (strategy.outer_lr, strategy.outer_momentum), which steps the anchor; every replica takes the
  new anchor. outer_lr 1 without momentum is local-sgd.
So the bytes between nodes are an all-reduce's every sync_every steps.

Replicas meet at the job steps that are multiples of sync_every, and at the job's end. A sync
point (schedule.py: an evaluation, a checkpoint, a request such as a stop signal) waits for the
next meeting: at a sync point every replica holds the same weights, a checkpoint taken there holds
the job's, and the meetings fall on the same steps whether or not the job was stopped and resumed
between them. Each replica's optimizer state is
its own; `replica_state` gives it to the checkpoint beside the replica's BatchNorm statistics
(replicas.py), so a resumed job goes on as the uninterrupted one; the outer optimizer's
momentum is the same in every replica and is saved once (`snapshot`).

Staleness: a replica's k-th step after a meeting is computed on weights that miss the others'
last k steps; the histogram counts k, 0..sync_every-1, mean (sync_every - 1) / 2 between
meetings that sync points do not bring forward.
"""

from __future__ import annotations

import torch
from torch._utils import _unflatten_dense_tensors

from ..stats import HIST_BINS
from .allreduce import AllReduce, average_, count_ring
from .base import Tick
from .traits import entry


class LocalSteps(AllReduce):
    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        s = self.cfg.strategy
        self.every = s.sync_every
        self.since = 0  # steps since the last meeting
        self.met = 0    # the job's images at the last meeting
        self.stale_hist = torch.zeros(HIST_BINS, dtype=torch.long)
        self.anchor = self.outer = None
        if entry(self.cfg).local == "outer":
            self.anchor = self._flat("anchor").clone()
            self.outer = torch.optim.SGD([self.anchor], lr=s.outer_lr, momentum=s.outer_momentum,
                                         nesterov=s.outer_momentum > 0)

    def wrap(self) -> torch.nn.Module:
        return self.model  # backward stays in the replica: no DistributedDataParallel

    def step(self, lr: float) -> Tick:
        asked = self._asked() if self.group is not None else bool(self.ctx.requests)
        self.set_lr(lr)
        self.optimizer.step()
        self.stale_hist[min(self.since, HIST_BINS - 1)] += 1
        self.since += 1
        self.counters.steps += 1
        s = self.schedule
        self.images += s.step_images
        stop = self.images >= s.target
        tick = Tick(self.images, False, stop)
        if stop or s.step_of(self.images) % self.every == 0:  # the same step in every replica
            self._meet()
            # A sync point the cadences made since the last meeting, or a request, is taken here
            tick = Tick(self.images, stop or asked or self.images >= s.next_point(self.met), stop)
            self.met = self.images
        self._ask(tick)
        return tick

    def _flat(self, name: str) -> torch.Tensor:
        """The weights end to end, in a buffer kept for `name`."""
        p = self.params[0]
        return torch.cat([q.detach().reshape(-1) for q in self.params],
                         out=self.buffer(name, self.numel, p.dtype, p.device))

    def _meet(self) -> None:
        """All-reduce the weights (local-sgd) or the change since the last meeting (diloco) into their
        mean; every replica then holds the same weights."""
        self.since = 0
        flat = self._flat("weights")
        if self.outer is not None:
            torch.sub(self.anchor, flat, out=flat)  # this replica's change, as a gradient of the anchor
        if self.group is not None:
            with self.counters.timed("comm_s"):
                average_([flat], self.group, self.world, out=self.buffer("mean", self.numel, flat.dtype, flat.device),
                         wire=self.wire and self.buffer("wire", self.numel, self.wire, flat.device))
            count_ring(self.counters, self.world, self.numel * (self.wire or flat.dtype).itemsize)
        if self.outer is not None:
            self.anchor.grad = flat
            self.outer.step()
            flat = self.anchor
        with torch.no_grad():
            for q, v in zip(self.params, _unflatten_dense_tensors(flat, self.params)):
                q.copy_(v)

    def replica_state(self) -> list[torch.Tensor]:
        """This replica's own optimizer state, for the checkpoint (see the module doc): every state
        tensor of a parameter's shape, in the parameters' order and by key."""
        state = self.optimizer.state
        return [t for q in self.params for _, t in sorted(state.get(q, {}).items())
                if isinstance(t, torch.Tensor) and t.shape == q.shape]

    def snapshot(self) -> dict:
        return {"outer": self.outer.state_dict()} if self.outer is not None else {}

    def restore(self, state: dict) -> None:
        super().restore(state)
        self.met = self.images  # a checkpoint is taken at a meeting
        if self.outer is not None:  # the checkpoint's weights are a meeting's: the anchor
            self.anchor.copy_(self._flat("weights"))
            if "outer" in state:
                self.outer.load_state_dict(state["outer"])

    def figures(self) -> dict:
        return {"hist": self.stale_hist}
