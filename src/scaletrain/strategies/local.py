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

With cluster.survive_loss the replicas meet over a Ring (comm/ring.py), which re-forms without a lost
node: each step ends in one collective on the host, two request values, and at a meeting the change
before them. The requests it carries are acted on at the next step (as the flag's all-reduce does),
so whether a step meets is known before its collective, and that collective is the same in every
member. A member one collective behind when the ring re-forms takes the front's state (weights,
optimizer, anchor, outer momentum, progress, where the front stood): where the front was in a
step's collective, its local step taken, the member takes part in that collective from there
(and skips its own next local step if it was behind in a sync point's); where the front had
finished the step and waits at the sync point after it, the member ends the step with the front's
tick. A replacement (cluster.replacements) takes the state at a step boundary. After
a loss a step applies the survivors' images, the meeting averages their changes, and each replica's
learning rate stays its own batch's (under cluster.after_loss = keep-batch each replica accumulates
more micro-batches). A checkpoint of such a job holds the chief's optimizer state alone, which every
replica of a resumed job takes.

Built on torch.distributed, not on torchft's LocalSGD and DiLoCo: theirs run under a torchft
Manager, its lighthouse and a quorum every step, which this job's fixed process plan does not
start; the replicas' groups, checkpoints and stop requests are the job's own (comm/, tracker.py).
"""

from __future__ import annotations

from dataclasses import astuple

import torch
from torch._utils import _unflatten_dense_tensors

from ..comm.liveness import CHECKPOINT, STOP
from ..comm.ring import Finished
from ..stats import HIST_BINS
from .allreduce import AllReduce, average_, count_ring
from .base import Tick
from .traits import entry


class LocalSteps(AllReduce):
    _adopted: dict | None = None  # a replacement's state, taken in AllReduce's making before these fields were
    # The ring's (module doc): whether this replica is in its step's collective, its local step taken; whether
    # the state it took was the front's in such a collective; the last step's tick, for a member behind
    _in_step = _mid = False
    last_tick = Tick(0, False, False)

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
        self.step_no = 0  # job steps (the ring's: its steps may apply fewer images than the schedule's)
        self.pending = 0  # the requests the ring's last collective carried, acted on at this step
        if self._adopted is not None:
            self._adopt_local(self._adopted)

    def wrap(self) -> torch.nn.Module:
        return self.model  # backward stays in the replica: no DistributedDataParallel

    def step(self, lr: float) -> Tick:
        if self.ring is not None:
            return self._ring_step(lr)
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

    def _ring_step(self, lr: float) -> Tick:
        """A local step, then the ring's collective: the requests, and at a meeting the changes (module doc)."""
        if not self._mid:  # (else this replica took a state the front had just stepped: its collective is next)
            try:
                self.ring.boundary()  # replacements the last collective admitted join here, before this step
            except Finished:
                return Tick(self.images, True, True)
            self.set_lr(lr)
            self.optimizer.step()
            self.stale_hist[min(self.since, HIST_BINS - 1)] += 1
            self.since += 1
            self.images += self.ring.size * self.cfg.data.batch_size * self.accum
            self.step_no += 1
        self._mid = False
        self.counters.steps += 1
        s, cpu = self.schedule, torch.device("cpu")
        while True:  # once, or again from the front's state where this member was a collective behind
            end = self.images >= s.target
            meet, synced = meeting(self.step_no, self.every, end, self.pending, self.images >= s.next_point(self.met))
            flat = self.buffer("ring meets" if meet else "ring", self.numel * meet + 2, self.wire or torch.float32,
                               cpu, pin=self.params[0].device.type == "cuda")
            if meet:
                change = self._change()
                if self.wire:  # summed in a half type: the parts of the mean, so it stays in range
                    change.div_(self.world)
                flat[:-2].copy_(change)
            r = 0 if synced else self.ctx.requests  # a sync point acts on them: any left go next step
            flat[-2:] = torch.tensor([float(bool(r & CHECKPOINT)), float(bool(r & STOP))])
            self._in_step = True
            try:
                with self.counters.timed("comm_s"):
                    if self.ring.allreduce(flat, small=2):
                        break
            except Finished:  # the others ended the job a step ahead of this replica: it ends too
                return Tick(self.images, True, True)
            finally:
                self._in_step = False
            if not self._mid:  # the front had finished this step (it waits at the sync point after it): its tick
                return self.last_tick
            self._mid = False  # the front was in its next step's collective, which this replica now joins
        n = self.members = self.ring.size
        count_ring(self.counters, n, flat.numel() * flat.element_size())
        asked, self.pending = self.pending, (CHECKPOINT if flat[-2] > 0 else 0) | (STOP if flat[-1] > 0 else 0)
        self.accum = self._accum_for(n)
        if meet:  # the mean over the members the sum ended with: the ring may have lost some meanwhile
            change = self._change()
            change.copy_(flat[:-2].mul_(self.world / n) if self.wire else flat[:-2].div_(n))
            self._take(change)
            self.met = self.images
        self.last_tick = Tick(self.images, synced, end, asked)
        return self.last_tick

    def _change(self) -> torch.Tensor:
        """This replica's change since the last meeting, anchor - weights, in a buffer of its own."""
        p = self.params[0]
        change = torch.cat([q.detach().reshape(-1) for q in self.params],
                           out=self.buffer("change", self.numel, p.dtype, p.device))
        return torch.sub(self.anchor, change, out=change)

    def _meet(self) -> None:
        """All-reduce the replicas' change since the last meeting into its mean and apply it (the module
        doc); every replica then holds the same weights, the new anchor."""
        p, change = self.params[0], self._change()
        if self.group is not None:
            with self.counters.timed("comm_s"):
                average_([change], self.group, self.world, out=self.buffer("mean", self.numel, p.dtype, p.device),
                         wire=self.wire and self.buffer("wire", self.numel, self.wire, p.device))
            count_ring(self.counters, self.world, self.numel * (self.wire or p.dtype).itemsize)
        self._take(change)

    def _take(self, change: torch.Tensor) -> None:
        """The replicas' mean change applied to the anchor, the new weights of every replica."""
        self.since = 0
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

    def _state(self) -> dict:
        return {**super()._state(), "anchor": self.anchor, "since": self.since, "met": self.met,
                "step_no": self.step_no, "pending": self.pending, "mid": self._in_step, "tick": astuple(self.last_tick),
                "outer": self.outer.state_dict() if self.outer is not None else None}

    def _adopt(self, state: dict) -> None:
        super()._adopt(state)
        if not hasattr(self, "anchor"):  # a replacement joining in AllReduce's making: after this class's fields
            self._adopted = state
        else:
            self._adopt_local(state)

    def _adopt_local(self, state: dict) -> None:
        self.anchor.copy_(state["anchor"])
        self.since, self.met, self.step_no, self.pending = (state[k] for k in ("since", "met", "step_no", "pending"))
        self._mid, self.last_tick = state["mid"], Tick(*state["tick"])
        if self.outer is not None:
            self.outer.load_state_dict(state["outer"])
        self._adopted = None

    def restore(self, state: dict) -> None:
        super().restore(state)
        self.met = self.images  # a checkpoint is taken at a meeting: its weights are the anchor
        self.step_no = self.schedule.step_of(self.images)
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
