"""The parameter-server loop of one shard.

The shard holds its slice of the parameters as one flat tensor, with the
optimizer state for it, a version counter (updates applied) and the job's
progress: images whose gradients it applied (schedule.py). Staleness of a
gradient = shard version when applied - version it was computed on.

- sync: gradients of the current version are summed until `wait_for` of the
  still-active pushers have sent theirs (all of them; N-b with backup
  workers); their mean is applied and every contributor gets the new values.
  A gradient computed on an older version is dropped, counted, and its
  sender gets the current values at once.
- async: each gradient is applied as it arrives and its sender gets the
  current values back; no pusher waits for another. Staleness-aware updates:
  with strategy.staleness_lr = inverse the gradient's learning rate is divided
  by its staleness + 1; with strategy.delay_compensation = lambda (DC-ASGD) it
  is first corrected by lambda * g * g * (w_now - w_then), w_then the values
  last sent to its pusher, which the shard keeps for each pusher.

Sync points (evaluation, checkpoint, the target, a request; schedule.py): the
update that brings the images to a point starts the shard's sync. Nothing more
is applied until every active pusher has been answered and the chief is back
(its next push, or its STOP): a push computed before the point is dropped and
answered with the point's values, flagged SYNC, so all pushers leave with the
same values; a push computed on them waits, unread, for the sync's end. The
sync is the workers' barrier: the chief evaluates and takes the shards' state
while it lasts, and a lost pusher cannot block it (LOST). Every shard sees
every push, so all shards reach the point at the same count. Once the target
is reached, every push is answered DONE and applies nothing: the job stops at
the same images whatever the strategy, and stragglers stop at their next push.

A lost pusher (LOST, from the chief; see comm/liveness.py) leaves `active`: no
update or sync waits for it any more. An exchange with a pusher that failed because
it died is skipped; the heartbeats decide whether the job goes on without it.

A REBUILD (cluster.survive_loss; strategies/ps_client.py, ps/takeover.py) makes this shard take on a lost one:
it serves it beside its own, on a thread and with that shard's own tags, from the values a
pusher sends and the optimizer state of the newest checkpoint.

A SNAPSHOT request (from the chief, at a checkpoint) is answered at once
with the version, the values and the optimizer state; `load` puts such a
snapshot back when a run resumes.

Messages are taken in the order they complete, not the order they started: a
push's header asks for its gradient, and while that crosses the pusher's link
the shard takes the other pushers' messages (up to FLYING gradients received at
once). So a pusher behind a slow link delays only its own gradient; under
backup workers and async the others are applied without it. gloo completes a
receive only in a wait, so each receive in flight is waited for by a thread of
its own (gloo lets go of the GIL meanwhile), which hands it to the loop.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from pathlib import Path

import torch

from .. import checkpoint, pipeline, schedule
from ..comm import p2p
from ..comm.liveness import HEARTBEAT_S, STALE_S
from ..data import build_datasets
from ..errors import CheckpointError
from ..models import build_model
from ..optim import compensate, lr_at, staleness_scale
from ..schedule import Schedule
from ..stats import HIST_BINS
from ..strategies import traits
from . import protocol as P
from . import takeover
from .shard_optim import ShardOptimizer
from .sharding import gather, make_layout, pieces

log = logging.getLogger("scaletrain")

FLYING = 4  # gradients a shard receives at once: memory of FLYING gradients of the shard's size


class Shard:
    def __init__(self, cfg, index: int, pushers: list[int], mode: str, wait_for: int, schedule: Schedule,
                 push_images: int, update_images: int, ctx=None, starts: list[int] | None = None,
                 tags: P.Tags = P.Tags(), run_dir: Path | None = None) -> None:
        """starts: with pipeline stages, the first layer of each (pipeline.py): this shard holds a part of
        stage index mod parallel.stages's parameters, shared out among that stage's shards. tags: its
        messages' (a shard taken on for a lost one has its own, protocol.tags). run_dir: the job's, whose
        checkpoints hold the state a shard taken on starts from."""
        torch.manual_seed(cfg.train.seed)  # the workers' initial model, bit for bit
        model = build_model(cfg.model)
        params = list(model.parameters() if starts is None else
                      pipeline.stage_module(model, starts, index % cfg.parallel.stages).parameters())
        shards = traits.stage_shards(cfg, index % cfg.parallel.stages)
        self.layout = make_layout([p.numel() for p in params], len(shards), cfg.cluster.sharding)
        self.values = torch.nn.Parameter(gather(params, self.layout.shards[shards.index(index)]).clone())
        # where each layer's piece lies in `values`, and whether it is a bias or a norm (sharding.Piece)
        self.pieces = pieces(self.layout.shards[shards.index(index)], [tuple(p.shape) for p in params])
        self.optimizer = ShardOptimizer(cfg, self.values, self.pieces)
        self.cfg, self.index, self.mode, self.wait_for, self.schedule = cfg, index, mode, wait_for, schedule
        self.tags, self.run_dir = tags, run_dir
        self.taken: list[tuple[Shard, threading.Thread]] = []  # shards taken on for lost ones (REBUILD)
        self.rebuilt: dict = {}  # a shard taken on: the version it was rebuilt at, and from which checkpoint
        self.push_images, self.update_images = push_images, update_images
        self.pushers, self.active, self.lost, self.ctx = list(pushers), set(pushers), set(), ctx
        self.chief = pushers[0]  # the chief's node pusher: the sync of a point ends when it is back
        self.version = self.images = 0
        self.hist = torch.zeros(HIST_BINS, dtype=torch.int64)
        self.stale_max, self.dropped, self.applied = 0, 0, 0
        self.by_sender = {r: [0, 0] for r in pushers}  # staleness sum and count of each pusher
        self.bytes_sent = self.bytes_recv = 0
        self.pending: list[int] = []  # sync: senders whose gradient is in `acc`
        self.acc = torch.zeros_like(self.values)
        wire = P.WIRE[cfg.strategy.compression]
        # A reply's values in the wire's type (strategy.compression), and a pushed gradient in fp32
        # (added and applied in it) when it comes in another type.
        self.wire = torch.empty(self.values.shape, dtype=wire) if wire else None
        self.grad = torch.empty_like(self.values) if wire else None
        # Pushes come into these (in the wire's type), made as needed, at most FLYING in use.
        self.inbox = wire or self.values.dtype
        self.spare: list[torch.Tensor] = []
        self.flying: dict[int, tuple] = {}  # src -> (version, requests, buffer, work): gradients on their way
        self.queued: list[tuple[int, int, int]] = []  # pushes (src, version, requests) waiting for a buffer
        self.done_q: queue.SimpleQueue = queue.SimpleQueue()  # (work, error) of each receive once it is over
        self.hdr = torch.zeros(P.HEADER, dtype=torch.int64)
        self.abandoned: list = []  # receives posted for a pusher lost since: never reused or freed
        self.syncing, self.answered, self.pulls = False, set(), []  # at a sync point, see the module doc
        self.waiting: list[tuple[int, int, int]] = []  # pushes (src, version, requests) that wait for the sync's end
        self.asked = 0  # requests pushers sent: the next update is a sync point
        self.point_asked = 0  # the requests of the current point
        self.stopped = 0  # the signal that stopped the job before its end (-1: unknown), see protocol.py
        self.over = False  # the chief stopped (a target accuracy or loss reached): every push is DONE
        st = cfg.strategy
        self.staleness_lr = st.staleness_lr if mode == "async" else "none"
        self.dc = st.delay_compensation if mode == "async" else 0.0
        # DC-ASGD: the values each pusher last received, on which it computes its next gradient
        self.sent = {r: self.values.detach().clone() for r in pushers} if self.dc else {}
        self.dc_buf = torch.empty_like(self.values) if self.dc else None

    @property
    def done(self) -> bool:
        return self.images >= self.schedule.target or self.over

    def serve(self) -> None:
        failures = 0
        hdr = self._watch(p2p.irecv(self.hdr, tag=self.tags.hdr))  # from any pusher
        while self.active:
            work, err = self.done_q.get()  # untimed: a pusher's life is the heartbeats' to judge
            if work is not hdr:
                self._received(work, err)
                continue
            if err is not None:  # a pusher died while its header was on its way
                failures += 1
                if failures > 3 or not self._gone(None, err):
                    raise err
                hdr = self._watch(p2p.irecv(self.hdr, tag=self.tags.hdr))
                continue
            failures = 0
            src, (version, command, flag) = p2p.source(work), self.hdr.tolist()
            hdr = self._watch(p2p.irecv(self.hdr, tag=self.tags.hdr))  # the next message's, from now on
            self.bytes_recv += P.HEADER * 8
            if command == P.LOST:
                self._drop(version)
            elif src in self.lost:  # a lost pusher that was only frozen: never answered (it exits)
                pass
            elif command == P.STOP:
                self.stopped = self.stopped or flag
                self.over |= src == self.chief
                self.active.discard(src)
                self._maybe_apply()
                self._release()
            elif command == P.SNAPSHOT:
                self._send_state(src)
            elif command == P.REBUILD:
                self.taken.append(takeover.take_on(self, src, version, flag))
            elif command == P.PULL:  # another shard announced a point: answer once this one is there too
                if self.syncing or self.done:
                    self._reply([src])
                else:
                    self.pulls.append(src)
            elif self.syncing and src in self.answered:  # computed on the point's values: after the sync
                self.waiting.append((src, version, flag))
                self._release()
            else:
                self._take(src, version, flag)

    def _watch(self, work):
        """Have a thread wait for `work` and put it, with its error or None, on done_q; returns it."""
        def wait() -> None:
            try:
                p2p.wait(work)
                self.done_q.put((work, None))
            except RuntimeError as e:
                self.done_q.put((work, e))

        threading.Thread(target=wait, name="ps-recv", daemon=True).start()
        return work

    def _take(self, src: int, version: int, requests: int) -> None:
        """Ask for the gradient of a push from `src`: now, or once a buffer is free."""
        if len(self.flying) >= FLYING:
            self.queued.append((src, version, requests))
            return
        buf = self.spare.pop() if self.spare else torch.empty(self.values.shape, dtype=self.inbox)
        work = self._watch(p2p.irecv(buf, src=src, tag=self.tags.vals))  # gloo's threads receive it from now on
        self.flying[src] = (version, requests, buf, work)

    def _received(self, work, err) -> None:
        """A push's gradient is in (or failed): its update, then the next push waiting for a buffer."""
        src = next((r for r, f in self.flying.items() if f[3] is work), None)
        if src is None:  # asked for from a pusher lost since: its buffer stays abandoned
            return
        version, requests, buf, _ = self.flying.pop(src)
        try:
            if err is None:
                self.bytes_recv += buf.numel() * buf.element_size()
                if not (self.syncing or self.done):
                    self.asked |= requests
                self._push(src, version, buf if self.grad is None else self.grad.copy_(buf))
            elif not self._gone(src, err):
                raise err
            else:
                self.active.discard(src)  # the chief's LOST follows, or the heartbeats end the job
        finally:
            self.spare.append(buf)
        self._fill()

    def _fill(self) -> None:
        """Ask for the gradients that waited for a buffer, while one is free."""
        while self.queued and len(self.flying) < FLYING:
            self._take(*self.queued.pop(0))

    def _drop(self, rank: int) -> None:
        """A pusher lost for good: go on without it."""
        if rank not in self.pushers or rank in self.lost:
            return
        log.warning("PS shard %d: going on without %s", self.index, self._name(rank))
        self.lost.add(rank)
        self.active.discard(rank)
        self.pulls = [r for r in self.pulls if r != rank]
        if rank in self.flying:  # gloo may still write into its buffer: never reused
            self.abandoned.append(self.flying.pop(rank))
        self.queued = [q for q in self.queued if q[0] != rank]
        self._fill()
        self.waiting = [w for w in self.waiting if w[0] != rank]
        self._maybe_apply()
        self._release()

    def _talk(self, peer: int, op) -> bool:
        """op(), a send to or receive from `peer`; False when it failed because the peer is gone
        (dead: its connection closed) and the job may go on without it."""
        try:
            op()
            return True
        except RuntimeError as e:
            if not self._gone(peer, e):
                raise
            self.active.discard(peer)  # the chief's LOST follows, or the heartbeats end the job
            return False

    def _gone(self, peer: int | None, err: RuntimeError) -> bool:
        """Whether `err` is the doing of a pusher (`peer`, or any when None) that is gone and
        that the job may go on without; waits for its heartbeat to age."""
        ctx = self.ctx
        if ctx is None or not ctx.tolerant:
            return False
        deadline = time.monotonic() + STALE_S + 2
        while time.monotonic() < deadline:
            gone = [r for r in ctx.gone + ctx.dropped if r in self.pushers and (peer is None or r == peer)]
            if gone:
                break
            time.sleep(HEARTBEAT_S)
        if not gone or not ctx.tolerate(gone):
            return False
        log.warning("PS shard %d: %s is gone (%s)", self.index, ", ".join(map(self._name, gone)),
                    str(err).splitlines()[0][:120])
        return True

    def _name(self, rank: int) -> str:
        return self.ctx.describe(rank) if self.ctx else f"rank {rank}"

    def _push(self, src: int, version: int, grad: torch.Tensor) -> None:
        if self.syncing or self.done:  # computed before the point: not applied
            self.dropped += 1
            self._reply([src])
        elif self.mode == "async":
            staleness = self.version - version
            self._record(src, staleness)
            if self.dc:
                compensate(grad, self.values.detach(), self.sent[src], self.dc, self.dc_buf)
            self._apply(grad, self.push_images, staleness_scale(self.staleness_lr, staleness))
            self._reply([src])
        elif version == self.version:
            if self.pending:
                self.acc.add_(grad)
            else:  # the first of a version is copied in: no pass to zero the sum
                self.acc.copy_(grad)
            self.pending.append(src)
            self._maybe_apply()
        else:  # computed on a version already applied: too late
            self.dropped += 1
            self._reply([src])

    def _maybe_apply(self) -> None:
        # The last update waits only for the pushes the target still needs: the stop is exact.
        left = -(-(self.schedule.target - self.images) // self.push_images)
        if self.pending and len(self.pending) >= min(self.wait_for, len(self.active), left):
            for src in self.pending:
                self._record(src, 0)
            # In place: a new tensor of the shard's size every update would cost its page faults.
            self._apply(self.acc.div_(len(self.pending)), len(self.pending) * self.push_images)
            senders, self.pending = self.pending, []
            self._reply(senders)

    def _apply(self, grad: torch.Tensor, images: int, lr_scale: float = 1.0) -> None:
        s = self.schedule
        self.optimizer.step(grad, lr_scale * lr_at(self.cfg.optim, s.step_of(self.images), s.steps, self.update_images))
        self.version += 1
        self.applied += 1
        before, self.images = self.images, self.images + images
        if self.images >= s.next_point(before) or self.asked:
            self.syncing, self.answered, self.point_asked, self.asked = True, set(), self.asked, 0
            pulls, self.pulls = self.pulls, []
            self._reply(pulls)

    def _record(self, src: int, staleness: int) -> None:
        self.hist[min(staleness, HIST_BINS - 1)] += 1
        self.by_sender[src][0] += staleness
        self.by_sender[src][1] += 1
        self.stale_max = max(self.stale_max, staleness)

    def _reply(self, dsts: list[int]) -> None:
        vals = self.values.detach()
        if self.wire is not None:  # a pusher computes on these rounded values
            vals = self.wire.copy_(vals)
        flags = (P.SYNC | self.point_asked << P.ASKED if self.syncing or self.done else 0) | \
            (P.DONE if self.done else 0)
        hdr = P.header(self.version, flags, self.images)

        def answer(dst: int) -> None:
            # The pusher posted its receives before pushing, so these do not wait on it.
            p2p.send(hdr, dst=dst, tag=self.tags.reply_hdr)
            p2p.send(vals, dst=dst, tag=self.tags.reply_vals)

        for dst in dsts:
            if dst not in self.lost and self._talk(dst, lambda: answer(dst)):
                self.bytes_sent += P.HEADER * 8 + vals.numel() * vals.element_size()
                if dst in self.sent:
                    self.sent[dst].copy_(vals)
        if self.syncing:
            self.answered.update(dsts)
            self._release()

    def _release(self) -> None:
        """The sync ends once every active pusher has the point's values and the chief is back;
        then the pushes that waited for it are taken in the order they came."""
        back = self.chief not in self.active or any(w[0] == self.chief for w in self.waiting)
        if not (self.syncing and self.answered >= self.active and back):
            return
        self.syncing = False
        waiting, self.waiting = self.waiting, []
        for src, version, requests in waiting:
            if src in self.active:
                self._take(src, version, requests)

    def state(self) -> list[torch.Tensor]:
        """The values, then the optimizer state tensors, each the shard's size (none before the first
        update): pieces' state laid end to end as their values are."""
        return [self.values.detach(), *self.optimizer.state()]

    def _send_state(self, dst: int) -> None:
        # Checkpoint traffic: not counted in the per-step bytes.
        tensors = self.state()
        p2p.send(P.header(self.version, len(tensors) - 1, self.images), dst=dst, tag=self.tags.snap)
        for t in tensors:
            p2p.send(t, dst=dst, tag=self.tags.snap)

    def load(self, saved: dict) -> None:
        """Continue from a snapshot of this shard (see PSClient.snapshot)."""
        values = saved["values"]
        if values.shape != self.values.shape:
            raise CheckpointError(f"the checkpoint holds {values.numel()} values for PS shard {self.index}, "
                                  f"which has {self.values.numel()}")
        with torch.no_grad():
            self.values.copy_(values)
        for w in self.sent.values():  # every pusher resumes from these values
            w.copy_(values)
        self.version = saved["version"]
        if saved["optimizer"]:
            self.optimizer.load(saved["optimizer"], self.version)
        self.images = saved.get("images", self.version * self.update_images)  # older checkpoints: derived


def run_shard(cfg, ctx, run_dir: Path, resume: bool) -> dict:
    """Be PS shard `ctx.me.index` until every pusher has stopped; returns its figures."""
    e, stages = traits.entry(cfg), cfg.parallel.stages
    pushers = traits.pushers(cfg, ctx.plan, ctx.me.index % stages)
    # Collective over the world when resuming: before anything the workers do after it
    found = checkpoint.load_agreed(run_dir / "checkpoints", distributed=True) if resume else None
    starts = None
    if stages > 1:  # the split the workers made (measured times, or their checkpoint's): the chief says it
        got = torch.zeros(stages, dtype=torch.int64)
        p2p.recv(got, src=ctx.plan.workers[0].rank, tag=P.TAG_SPLIT)
        starts = got.tolist()
    train_images = 0
    if not cfg.train.steps:  # the run's length comes from the epoch size; only then is the data read
        train_images = len(build_datasets(cfg, check=False)[0])  # its files: the workers' to read
    shard = Shard(cfg, ctx.me.index, pushers, e.server, traits.wait_for(cfg, len(pushers)),
                  schedule.from_config(cfg, train_images), traits.push_images(cfg),
                  traits.images_per_update(cfg), ctx, starts, run_dir=run_dir)
    if found is not None:  # the workers load the same file and check its config
        state, path = found
        shards = state.get("ps") or []
        if ctx.me.index >= len(shards):
            raise CheckpointError(f"{path} holds {len(shards)} parameter-server shards; "
                                  f"this run has {cfg.cluster.num_ps}")
        shard.load(shards[ctx.me.index])
        log.info("PS shard %d resumed from %s at version %d", ctx.me.index, path, shard.version)
    shard.serve()
    for _, thread in shard.taken:  # until their pushers have stopped too
        thread.join()
    return dict(is_ps=1, node=ctx.me.node, pusher=0, **takeover.figures([shard] + [s for s, _ in shard.taken]),
                stopped=shard.stopped, step=shard.schedule.step_of(shard.images))
