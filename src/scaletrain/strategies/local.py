"""Local SGD and DiLoCo: replicas step alone and meet every strategy.sync_every steps.

Between meetings a replica applies its own gradient through its own optimizer, whose state stays
its own (Lin et al. 2020, "Don't use large mini-batches, use local SGD"; Douillard et al. 2023,
"DiLoCo"), and nothing crosses the network but the request flag of allreduce.py (one value a
step, which keeps the replicas within a step of each other). At a meeting the replicas all-reduce
one flat tensor of the weights' size, their change since the last meeting, anchor - weights (the
anchor: the weights of the last meeting; small values, which strategy.compression's half types
carry where the weights themselves would lose their small updates), into its mean:
- local-sgd: the anchor minus the mean change, the mean of the weights, becomes every replica's.
- diloco: the mean change is the gradient of an outer optimizer, SGD with Nesterov momentum
  (strategy.outer_lr, strategy.outer_momentum), which steps the anchor; every replica takes it.
  outer_lr 1 without momentum is local-sgd.
So the bytes between nodes are an all-reduce's every sync_every steps.

Replicas meet at the job steps that are multiples of sync_every, and at the job's end. A sync
point (schedule.py: an evaluation, a checkpoint, a timed checkpoint's request) waits for the next
meeting, so the meetings fall on the same steps whether or not the job was checkpointed and
resumed between them; at a sync point every replica holds the same weights, and a checkpoint
taken there holds the job's. A stop (a signal: DESIGN rule 18) does not wait: the replicas meet
at the step every one of them has seen it, and the resumed job meets at the multiples again.
Each replica's optimizer state is its own; `replica_state` gives it to the checkpoint beside the
replica's BatchNorm statistics (replicas.py), so a resumed job goes on as the uninterrupted one;
the outer optimizer's momentum is the same in every replica and is saved once (`snapshot`).

Staleness: a replica's k-th step after a meeting is computed on weights that miss the others'
last k steps; the histogram counts k, 0..sync_every-1, mean (sync_every - 1) / 2.

Built on torch.distributed, not on torchft's LocalSGD and DiLoCo: theirs run under a torchft
Manager, its lighthouse and a quorum every step, which this job's fixed process plan does not
start; the replicas' groups, checkpoints and stop requests are the job's own (comm/, tracker.py).
"""

from __future__ import annotations

import torch
from torch._utils import _unflatten_dense_tensors

from ..comm.liveness import STOP
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
        self.anchor = torch.cat([q.detach().reshape(-1) for q in self.params])  # the weights of the last meeting
        self.outer = torch.optim.SGD([self.anchor], lr=s.outer_lr, momentum=s.outer_momentum,
                                     nesterov=s.outer_momentum > 0) if entry(self.cfg).local == "outer" else None

    def wrap(self) -> torch.nn.Module:
        return self.model  # backward stays in the replica: no DistributedDataParallel

    def step(self, lr: float) -> Tick:
        asked = self._asked() if self.group is not None else self.ctx.requests
        self.set_lr(lr)
        self.optimizer.step()
        self.stale_hist[min(self.since, HIST_BINS - 1)] += 1
        self.since += 1
        self.counters.steps += 1
        s = self.schedule
        self.images += s.step_images
        end = self.images >= s.target
        # The same in every replica: the images, the target and the requests are agreed
        meet, synced = meeting(s.step_of(self.images), self.every, end, asked, self.images >= s.next_point(self.met))
        if meet:
            self._meet()
            self.met = self.images
        tick = Tick(self.images, synced, end)
        self._ask(tick)
        return tick

    def _meet(self) -> None:
        """All-reduce the replicas' change since the last meeting into its mean and apply it (the module
        doc); every replica then holds the same weights, the new anchor."""
        self.since = 0
        p = self.params[0]
        change = torch.cat([q.detach().reshape(-1) for q in self.params],
                           out=self.buffer("change", self.numel, p.dtype, p.device))
        torch.sub(self.anchor, change, out=change)
        if self.group is not None:
            with self.counters.timed("comm_s"):
                average_([change], self.group, self.world, out=self.buffer("mean", self.numel, p.dtype, p.device),
                         wire=self.wire and self.buffer("wire", self.numel, self.wire, p.device))
            count_ring(self.counters, self.world, self.numel * (self.wire or p.dtype).itemsize)
        if self.outer is None:
            self.anchor.sub_(change)
        else:
            self.anchor.grad = change
            self.outer.step()
        with torch.no_grad():
            for q, v in zip(self.params, _unflatten_dense_tensors(self.anchor, self.params)):
                q.copy_(v)

    def replica_state(self) -> list[torch.Tensor]:
        """This replica's own optimizer state, for the checkpoint (see the module doc): every floating
        state tensor on its parameter's device but the step counts (the same in every replica), in the
        parameters' order and by key."""
        state = self.optimizer.state
        return [t for q in self.params for key, t in sorted(state.get(q, {}).items())
                if key != "step" and isinstance(t, torch.Tensor) and t.is_floating_point() and t.device == q.device]

    def snapshot(self) -> dict:
        return {"outer": self.outer.state_dict()} if self.outer is not None else {}

    def restore(self, state: dict) -> None:
        super().restore(state)
        self.met = self.images  # a checkpoint is taken at a meeting: its weights are the anchor
        torch.cat([q.detach().reshape(-1) for q in self.params], out=self.anchor)
        if self.outer is not None and "outer" in state:
            self.outer.load_state_dict(state["outer"])

    def figures(self) -> dict:
        return {"hist": self.stale_hist}


def meeting(step: int, every: int, end: bool, asked: int, point_due: bool) -> tuple[bool, bool]:
    """(whether the replicas meet after job step `step`, whether it is a sync point): they meet at the
    multiples of `every`, at the end and at a stop any replica asked for (asked: the agreed requests,
    liveness.CHECKPOINT | STOP); a meeting is a sync point at the end, at a request, or where a point of
    the schedule's cadences came since the last meeting (point_due)."""
    meet = end or step % every == 0 or bool(asked & STOP)
    return meet, meet and (end or bool(asked) or point_due)
