"""All-reduce: no parameter server; replicas average gradients and step identical optimizers.

Where the replica runs backward, its forward goes through DistributedDataParallel
(`wrap`): the gradients are all-reduced in buckets while backward still runs, and
backward returns with them averaged. Its communication hook sends the
buckets in a half type (strategy.compression) and measures the gradient noise
scale on the way (noise.py). Where nothing runs
backward (train.emulate_compute_s fills .grad itself, compute.py) there are no
hooks to fire, and `step` averages every gradient in one flat all-reduce instead.

Whether any replica holds a request (a stop signal, a timed checkpoint) travels in
a one-element all-reduce started at the end of a step and read at the next: it
overlaps that step's compute and costs no host-device sync, and every replica makes
the same step its sync point, one step after the request came.

With cluster.survive_loss the replicas average over a Ring instead (comm/ring.py), a
group that re-forms without a lost node: no DDP (its group is fixed at its making),
one flat all-reduce on the host after backward, the requests riding in its last two
elements. After a loss an update averages the survivors' gradients, and the learning
rate follows the smaller batch by the recipe's rule (optim.peak_lr).
"""

from __future__ import annotations

import inspect
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch._utils import _unflatten_dense_tensors
from torch.nn.parallel import DistributedDataParallel

from ..comm.liveness import CHECKPOINT, STOP
from ..comm.ring import Finished, Ring
from ..noise import NoiseScale
from ..optim import peak_lr
from .base import Strategy, Tick
from .traits import replica_images

NO_BUFFER_SYNC = "forward_sync_buffers" if "forward_sync_buffers" in \
    inspect.signature(DistributedDataParallel).parameters else "broadcast_buffers"


def data_parallel(model: torch.nn.Module, group, wire: torch.dtype | None = None, counters=None,
                  noise: NoiseScale | None = None) -> DistributedDataParallel:
    """`model` under DistributedDataParallel over `group`: backward returns with the gradients averaged
    over it, their buckets all-reduced while it still runs (in `wire`'s type when given, counting in
    `counters` what each bucket's all-reduce sends: once an update, with gradient accumulation, whose
    other micro-batches' backwards sync nothing: Strategy.sync_backward), and, with `noise`, each
    bucket's squared norms before and after."""
    dev = next(model.parameters()).device
    # init_sync off: every replica already holds the same values (one seed, or one checkpoint), and
    # a broadcast from the first would overwrite each replica's own BatchNorm statistics on resume.
    # No broadcast before each forward either, for the same statistics (replicas.py evaluates and
    # saves them); torch 2.13 renamed that switch.
    ddp = DistributedDataParallel(model, device_ids=[dev] if dev.type == "cuda" else None, process_group=group,
                                  init_sync=False, gradient_as_bucket_view=True, **{NO_BUFFER_SYNC: False})
    if wire is not None or noise is not None or counters is not None:
        ddp.register_comm_hook((group, wire, counters, noise), bucket_hook)
    return ddp


def bucket_hook(state, bucket):  # unannotated: DDP checks a return annotation against the type itself
    """A DDP communication hook: the bucket divided by the group's size and all-reduced, as DDP's own
    all-reduce does, in a half type when `wire` is given (half the bytes of fp32), the bytes it sends
    counted in `counters` when given, so a figure of bytes is of what crossed (torch's fp16/bf16 hooks
    and DDP's own all-reduce say nothing of it), and
    with `noise` the squared norms of this replica's bucket and of the group's mean (noise.py).
    Neither costs a host-device sync."""
    group, wire, counters, noise = state
    buffer = bucket.buffer()
    size = dist.get_world_size(group)
    own = torch.dot(buffer, buffer) if noise is not None else None
    moving = buffer.div_(size) if wire is None else buffer.to(wire).div_(size)
    if counters is not None:
        count_ring(counters, size, moving.numel() * moving.element_size())
    fut = dist.all_reduce(moving, group=group, async_op=True).get_future()  # collective, overlaps backward

    index = bucket.index()

    def unpack(f):  # may run beside other buckets' (on GPU: a pool of streams): noise.add writes its own slot
        mean = f.value()[0] if wire is None else buffer.copy_(f.value()[0])
        if noise is not None:
            noise.add(own, torch.dot(mean, mean), index)
        return mean

    return fut.then(unpack)


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
        # Collective. gloo returns when every member has joined; NCCL once it is queued, and the stream
        # waits instead: the counters' events see that wait, a host clock would not.
        dist.all_reduce(moving, group=group)
    if wire is None:
        flat /= size
    else:
        flat.copy_(wire)
    if counters:
        count_ring(counters, size, moving.numel() * moving.element_size(), what)
    for t, v in zip(tensors, _unflatten_dense_tensors(flat, tensors)):
        t.copy_(v)


def count_ring(counters, size: int, nbytes: int, what: str = "comm_s") -> None:
    """Count what a ring all-reduce of `nbytes` moves for each member: 2(n-1)/n of it sent and received."""
    moved = int(2 * (size - 1) / size * nbytes)
    if what == "intra_s":
        counters.intra_bytes += moved
    else:
        counters.bytes_sent += moved
        counters.bytes_recv += moved


class AllReduce(Strategy):
    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.world = self.ctx.plan.replicas
        self.group = self.ctx.workers_group  # None when this is the only replica (with stages: of this stage)
        self.ddp: DistributedDataParallel | None = None
        self.flag = torch.zeros(1)  # the requests (liveness.CHECKPOINT | STOP), on the host: no device sync
        self.asking = None  # the flag's all-reduce in flight (its work, comm/p2p.py)
        # A replacement (ctx.late) has no group: it joins the ring, and takes a member's state there
        self.ring = Ring(self.ctx, self._state, self._adopt) \
            if self.ctx.tolerant and (self.group is not None or self.ctx.late) else None

    def wrap(self) -> torch.nn.Module:
        if self.group is None or self.ring is not None:  # alone, or the ring averages in step()
            return self.model
        if self.ddp is None:
            b, k = replica_images(self.cfg), self.cfg.train.grad_accum_steps
            # Not with stages: a bucket holds a part of the gradient, summed over micro-batches
            self.noise = None if self.ctx.plan.stages > 1 else NoiseScale(b, b * self.world, self.params[0].device, k)
            self.ddp = data_parallel(self.model, self.group, self.wire, self.counters, self.noise)
        return self.ddp

    def step(self, lr: float) -> Tick:
        if self.ring is not None:
            return self._ring_step(lr)
        asked = None
        if self.group is not None:
            grads = self.grads()
            if self.ddp is None:  # no backward ran through DDP: average here
                dev, dtype = grads[0].device, grads[0].dtype
                with self.counters.timed("comm_s"):
                    average_(grads, self.group, self.world, out=self.buffer("grads", self.numel, dtype, dev),
                             wire=self.wire and self.buffer("wire", self.numel, self.wire, dev))
                count_ring(self.counters, self.world, self.numel * (self.wire or dtype).itemsize)
            asked = self._asked()
        if self.ddp is not None and self.noise is not None:  # the hook measured this backward's buckets
            self.noise.step()
        self.set_lr(lr)
        self.optimizer.step()
        self.counters.steps += 1
        tick = self.advance(self.schedule.step_images, None if asked is None else bool(asked))
        self._ask(tick)
        return tick

    def _ring_step(self, lr: float) -> Tick:
        """One update over the ring: the gradients' sum and the requests' in one collective on the host,
        the mean over the members it ended with; a replica that was behind took the front's update."""
        grads, before, r = self.grads(), self.images, self.ctx.requests
        dev = grads[0].device  # gloo's collective runs on the host: pinned memory, one copy each way
        flat = self.buffer("ring", self.numel + 2, self.wire or torch.float32, torch.device("cpu"),
                           pin=dev.type == "cuda")
        mine = torch.cat([g.reshape(-1) for g in grads])
        if self.wire:  # summed in a half type: the parts of the mean, not of the sum, so it stays in range
            mine.div_(self.world)  # one divisor for every member, whoever joined or left since
        flat[:-2].copy_(mine)  # on a GPU a host-device sync, every step
        flat[-2:] = torch.tensor([float(bool(r & CHECKPOINT)), float(bool(r & STOP))])
        try:
            with self.counters.timed("comm_s"):
                self.ring.boundary()  # replacements the last collective admitted join here, before this one
                applied = self.ring.allreduce(flat, small=2)
        except Finished:  # the others reached the job's target a step ahead of this replica: it ends too
            return Tick(self.images, True, True)
        n = self.ring.size
        count_ring(self.counters, n, flat.numel() * flat.element_size())
        asked = (CHECKPOINT if flat[-2] > 0 else 0) | (STOP if flat[-1] > 0 else 0)
        if applied:
            mean = flat[:-2].to(dev, torch.float32)  # on a GPU one copy to it; on the host, flat itself
            # Divided by the members the sum ended with: the ring may have lost some meanwhile
            if self.wire:
                mean.mul_(self.world / n)
            else:
                mean.div_(n)
            for g, v in zip(grads, _unflatten_dense_tensors(mean, grads)):
                g.copy_(v)
            images = n * self.cfg.data.batch_size * self.accum
            # The rate of an update of the survivors' images, by the recipe's rule, against the job's full one
            self.lr_scale = peak_lr(self.cfg.optim, images) / peak_lr(self.cfg.optim, self.schedule.step_images)
            self.set_lr(lr * self.lr_scale)
            self.optimizer.step()
            self.images += images
            self.accum = self._accum_for(n)  # a member behind took the front's (adopt)
        # else: the front's update is this replica's now (Ring.adopt); its own gradient goes unused
        self.members = n
        self.counters.steps += 1
        return Tick(self.images, bool(asked) or self.images >= self.schedule.next_point(before),
                    self.images >= self.schedule.target, asked)

    def _accum_for(self, n: int) -> int:
        """The micro-batches of each replica's next update in a ring of n: the recipe's, or under
        cluster.after_loss = keep-batch as many more as keep the global batch (at least it)."""
        k = self.cfg.train.grad_accum_steps
        return -(-k * self.world // n) if self.cfg.cluster.after_loss == "keep-batch" else k

    def _state(self) -> dict:
        """What this replica holds, for one that was behind when the ring re-formed, or a replacement (Ring.adopt)."""
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "images": self.images,
                "lr_scale": self.lr_scale, "accum": self.accum}

    def _adopt(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.images, self.lr_scale, self.accum = state["images"], state["lr_scale"], state["accum"]

    def healed(self, k: int) -> dict | None:
        if self.ring is None:
            return {}
        if set(self.ring.members) & set(self.ctx.dropped):
            return None  # dropped while this replica computed: its next collective re-forms the ring
        if not self.ring.losses:  # dropped before the first ring was made: it never held them
            return {}
        loss = self.ring.losses[min(k, len(self.ring.losses) - 1)]
        return {"steps_lost": int(loss["behind"]), "heal_s": round(loss["healed_s"], 3)}

    def joined(self, final: bool = False) -> list[dict]:
        return [] if self.ring is None else self.ring.joined(final)

    def agree_stop(self, stop: bool) -> bool:
        """Over the ring: whether the chief, which evaluated alone, stops."""
        if self.ring is None:
            return stop
        t = torch.tensor([float(stop)])
        try:
            self.ring.allreduce(t, small=1, op=dist.ReduceOp.MAX)
        except Finished:
            return True
        return bool(t[0] > 0)

    def _ask(self, tick: Tick) -> None:
        """Start the all-reduce of whether this replica holds a request, read at the next step (_asked)."""
        if self.group is not None and not tick.stop:
            # Not at a sync point: it acts on the requests; one left after it goes next step. The largest
            # wins: STOP is the high bit, so any replica's stop shows (its checkpoint comes with it).
            self.flag.fill_(0 if tick.synced else self.ctx.requests)
            self.asking = dist.all_reduce(self.flag, op=dist.ReduceOp.MAX, group=self.ctx.workers_cpu_group,
                                          async_op=True)  # collective

    def finish(self, stopped: int = 0) -> None:
        if self.asking is not None:  # every replica started it: it completes
            self.asking.wait()

    def _asked(self) -> int:
        """The requests any replica held at the end of the previous step (liveness: CHECKPOINT, STOP; the
        strongest one's), 0 for none."""
        if self.asking is None:
            return 0
        with self.counters.timed("comm_s"):
            # In flight since the previous step: done by now unless a replica lags. A host wait (gloo, host
            # flag); on a GPU the events count it where the stream idles through it.
            self.asking.wait()
        self.asking = None
        return int(self.flag.item())
