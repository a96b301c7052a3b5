"""The worker side of the parameter-server strategies (sync, mixed-async, async, backup).

Per step: average inside the node (unless every replica pushes on its own),
then the pusher sends to each PS shard its slice of the gradient tagged with
the shard version it was computed on, receives the shard's current values
and the job's progress, and shares both inside the node. What the shard does with the gradient
(wait for all nodes, for the first N-b, or apply at once) is the server's
mode; this side is the same for all four.

When the chief declares a worker node lost (comm/liveness.py), its heartbeat thread
tells every shard (LOST, `_announce`): the message that wakes a shard waiting
for nobody but the lost. It is a second thread sending to the shards beside
the main one; gloo's pairs take sends from several threads, and the shard
tells the messages apart by their command.

A lost PS shard (cluster.survive_loss): every pusher's exchange with it fails
(a killed shard closes its connections; a frozen one is killed by its launcher
once dropped), and once the chief has declared it lost each pusher says in the
store which version of the shard's values it holds (`ps/K/RANK/held/...`). The
chief picks the newest holder and a live shard to take it on; the holder sends
that shard its values (REBUILD), which it serves from then on beside its own,
with the optimizer state of the newest checkpoint; every pusher then sends shard
K's messages there, on K's own tags, and redoes the exchange that failed. No
update's values are lost: the newest holder has every update the shard
answered, and a push it had not answered is sent again. What is lost is the
optimizer state's updates since the checkpoint (momentum, RMSProp's squares),
counted as `updates_lost`.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch._utils import _unflatten_dense_tensors

from ..comm import p2p
from ..comm.end import _main_store
from ..comm.liveness import CHECKPOINT, HEARTBEAT_S, STALE_S, STOP
from ..errors import CheckpointError
from ..optim import state_keys
from ..ps import protocol as P
from ..ps.sharding import gather, make_layout, scatter_
from ..noise import NoiseScale
from .allreduce import average_, count_ring, data_parallel
from .base import Strategy, Tick
from .traits import pushers, replica_images, stage_shards


class PSClient(Strategy):
    def __init__(self, cfg, ctx, model, optimizer, schedule, per_node: bool) -> None:
        super().__init__(cfg, ctx, model, optimizer, schedule)
        self.per_node = per_node
        self.group = ctx.node_group if per_node else None
        self.group_size = len(ctx.node_workers()) if per_node else 1
        self.pusher = not per_node or ctx.me.replica == 0
        self.leader = ctx.node_workers()[0] if per_node else ctx.rank
        # With pipeline stages a stage's shards hold its parameters (traits.stage_shards): this process's
        self.shards = stage_shards(cfg, ctx.me.stage)
        self.layout = make_layout([p.numel() for p in self.params], len(self.shards), cfg.cluster.sharding)
        self.servers = [ctx.plan.ps[k].rank for k in self.shards]
        self.tags = [P.Tags() for _ in self.servers]  # a shard's messages' tags (another's, once it took it on)
        self.shard_images = [0] * len(self.servers)  # the job's images as each shard last reported them
        self.rebuilds: list[dict] = []  # the chief: each lost shard taken on, for lost_workers
        self._abandoned: list = []  # buffers of receives from a lost shard: never reused
        self.stage_numels: list[list[int]] | None = None  # every stage's parameter sizes (set_stages)
        self.versions = [0] * len(self.servers)
        self.on_gpu = self.params[0].device.type == "cuda"  # messages go through host buffers (gloo)
        self.ddp = None
        self._told: list = []  # LOST sends in flight (a shard that has stopped serving never takes them)
        if ctx.is_chief:
            ctx.on_drop = self._announce

    def _announce(self, ranks: list[int]) -> None:
        """The chief's heartbeat thread: tell the shards to go on without these pushers."""
        told = pushers(self.cfg, self.ctx.plan)
        for server, tags in zip(self.servers, self.tags):
            for r in ranks:
                if server in ranks or r not in told:
                    continue
                try:
                    self._told.append(dist.isend(P.header(r, P.LOST), dst=server, tag=tags.hdr))
                except RuntimeError:  # that shard is gone: the heartbeats end the job
                    pass

    def wrap(self) -> torch.nn.Module:
        """Where a node's replicas average before pushing: DistributedDataParallel over the node, so the
        averaging runs while backward does (the node's GPUs: NCCL); the push follows it."""
        if self.group is not None and self.ddp is None:
            b, k = replica_images(self.cfg), self.cfg.train.grad_accum_steps
            # Not with stages: a bucket holds a part of the gradient, summed over micro-batches
            self.noise = None if self.ctx.plan.stages > 1 else \
                NoiseScale(b, b * self.group_size, self.params[0].device, k)
            self.ddp = data_parallel(self.model, self.group, noise=self.noise)
        return self.ddp or self.model

    def agree_stop(self, stop: bool) -> bool:
        """A node's replicas share every step's values: they stop with their leader, which is the chief
        on the chief's node (else one would wait for the other in the next backward). Collective over
        the node: 8 bytes."""
        if self.group is None:
            return stop
        flag = torch.tensor([int(stop)], dtype=torch.int64, device=self.params[0].device)
        dist.broadcast(flag, src=self.leader, group=self.group)
        return bool(flag.item())

    def step(self, lr: float) -> Tick:
        # The clocks are the device's events (Counters): they need no sync here, starting where the
        # stream reaches them. The push syncs once its payloads are queued, as it needs them on the host.
        grads = self.grads()
        if self.ddp is not None:  # averaged in backward
            if self.noise is not None:
                self.noise.step()
            count_ring(self.counters, self.group_size, self.numel * grads[0].element_size(), "intra_s")
        elif self.group is not None:  # no backward ran through DDP (train.emulate_compute_s): average here
            average_(grads, self.group, self.group_size, self.counters, "intra_s", self._flat("grads"))
        # [images, flags]: the job's progress as the shards reported it to this node's pusher
        info = torch.zeros(2, dtype=torch.int64, device=self.params[0].device)
        if self.pusher:
            with self.counters.timed("comm_s"):
                info[0], info[1] = self._push_pull(grads)
        if self.group is not None:
            flat = torch.cat([p.data.reshape(-1) for p in self.params], out=self._flat("values"))
            with self.counters.timed("intra_s"):
                dist.broadcast(flat, src=self.leader, group=self.group)  # collective: leader's new values
                dist.broadcast(info, src=self.leader, group=self.group)  # collective: 16 bytes
            if self.pusher:
                self.counters.intra_bytes += flat.numel() * flat.element_size() + 16
            for p, v in zip(self.params, _unflatten_dense_tensors(flat, self.params)):
                p.data.copy_(v)
        self.counters.steps += 1
        images, flags = info.tolist()  # host-device sync on GPU: the Tick is the host's (a replica that is
        # not the pusher waits here for the leader's broadcast; its events count that wait in intra_s)
        return Tick(images, bool(flags & P.SYNC), bool(flags & P.DONE), flags >> P.ASKED)

    def _flat(self, name: str) -> torch.Tensor:
        """A buffer for all the parameters (or gradients) end to end."""
        return self.buffer(name, self.numel, self.params[0].dtype, self.params[0].device)

    def _exchange(self, msgs: list[tuple[int, torch.Tensor, torch.Tensor | None]]) -> list[torch.Tensor]:
        """Send (shard, header, payload) messages and receive each shard's reply into the
        parameters; returns the reply headers. Payloads and replies are host tensors (gloo). A shard
        lost meanwhile is taken on by another (the module doc), and its exchange redone there."""
        replies, works, failed = [], {}, {}
        for k, hdr_out, payload in msgs:
            server, tags = self.servers[k], self.tags[k]
            hdr = torch.zeros(P.HEADER, dtype=torch.int64)
            vals = self.buffer(f"reply {k}", self.layout.numel(k), self.wire or torch.float32, torch.device("cpu"),
                               pin=self.on_gpu)
            replies.append((k, hdr, vals))
            try:  # (a lost shard's connection, once closed, fails them as they are posted)
                # Post the receives first: the server answers as soon as it has applied.
                works[k] = [dist.irecv(hdr, src=server, tag=tags.reply_hdr),
                            dist.irecv(vals, src=server, tag=tags.reply_vals),
                            dist.isend(hdr_out, dst=server, tag=tags.hdr)]
                if payload is not None:
                    works[k].append(dist.isend(payload, dst=server, tag=tags.vals))
            except RuntimeError as e:
                failed[k] = e
            self.counters.bytes_sent += P.HEADER * 8 + (payload.numel() * payload.element_size() if payload is not None
                                                        else 0)
        for k, ws in works.items():
            try:
                for w in ws:
                    p2p.wait(w)  # point-to-point; returns when the shard has answered (liveness is the heartbeats')
            except RuntimeError as e:
                failed[k] = e
        lost = []
        for k, e in failed.items():
            if not self._taken_on(k, e):
                raise e
            lost.append(k)
        out = {}
        for k, hdr, vals in replies:
            if k in lost:  # gloo may hold the buffer yet: never reused
                self._abandoned.append(self._buffers.pop(f"reply {k}"))
                continue
            out[k] = hdr
            self.versions[k], self.shard_images[k] = int(hdr[0]), int(hdr[2])
            self.counters.bytes_recv += P.HEADER * 8 + vals.numel() * vals.element_size()
            if self.on_gpu:  # one host-to-device copy a shard, queued; the scatter follows it on the device
                vals = self.buffer(f"reply {k} on device", vals.numel(), vals.dtype, self.params[0].device) \
                    .copy_(vals, non_blocking=True)
            scatter_(self.params, self.layout.shards[k], vals)
        for k, hdr_out, payload in msgs:
            if k in lost:  # again, to the shard that took it on
                out[k] = self._exchange([(k, hdr_out, payload)])[0]
        return [out[k] for k, _, _ in msgs]

    def _taken_on(self, k: int, err: RuntimeError) -> bool:
        """Shard k's exchange failed: where its server was lost and the job goes on (cluster.survive_loss),
        once another shard has taken k on (the module doc), True, and k's messages go there from now on."""
        dead, ctx = self.servers[k], self.ctx
        if not self.cfg.cluster.survive_loss:
            return False
        failed_at, deadline = time.perf_counter(), time.monotonic() + ctx.timeout_s + 2 * STALE_S + 10
        while dead not in ctx.dropped:  # the chief's word decides (the heartbeats bound it)
            if time.monotonic() > deadline:
                return False
            time.sleep(HEARTBEAT_S / 5)
        store, key = _main_store(ctx), f"ps/{k}/{dead}"
        store.set(f"{key}/held/{ctx.rank}", f"{self.versions[k]},{self.shard_images[k]}")
        if ctx.is_chief:
            self._plan_rebuild(store, key, dead)
        src, adopter = map(int, self._wait_key(store, f"{key}/plan").split(","))
        if src == ctx.rank:  # the newest values are this pusher's: it sends them
            values = gather(self.params, self.layout.shards[k], torch.empty(self.layout.numel(k)))
            p2p.send(P.header(self.versions[k], P.REBUILD, k), dst=adopter, tag=P.TAG_HDR)
            p2p.send(torch.tensor([self.shard_images[k]], dtype=torch.int64), dst=adopter, tag=P.TAG_REBUILD)
            p2p.send(values, dst=adopter, tag=P.TAG_REBUILD)
            ack = torch.zeros(P.HEADER, dtype=torch.int64)
            p2p.recv(ack, src=adopter, tag=P.TAG_REBUILD)
            store.set(f"{key}/at", f"{self.versions[k]},{int(ack[0])}")
        version, saved = map(int, self._wait_key(store, f"{key}/at", src).split(","))
        self.servers[k], self.tags[k] = adopter, P.tags(k)
        if ctx.is_chief:
            self.rebuilds.append({"ranks": [dead], "shard": k, "taken_on_by": adopter, "version": version,
                                  "updates_lost": version - saved if saved >= 0 else version,
                                  "heal_s": round(time.perf_counter() - failed_at, 3)})
        return True

    def _plan_rebuild(self, store, key: str, dead: int) -> None:
        """The chief: once every live pusher said which version it holds, the newest holder and the live shard
        that takes the lost one on (the next in shard order). Every pusher gets there at its next exchange with
        the lost shard, however long its work takes: without the newest holder a synchronous shard would wait
        for a gradient of a version its pushers have left. One lost meanwhile, or done, is not waited for."""
        while True:
            live = [r for r in pushers(self.cfg, self.ctx.plan)
                    if r not in self.ctx.dropped and not store.check([f"done/{r}"])]
            held = {r: int(store.get(f"{key}/held/{r}").decode().split(",")[0])
                    for r in live if store.check([f"{key}/held/{r}"])}
            if len(held) == len(live):
                break
            time.sleep(HEARTBEAT_S / 5)
        src = min(held, key=lambda r: (-held[r], r))
        ranks = [p.rank for p in self.ctx.plan.ps]
        at = ranks.index(dead)
        adopter = next(r for r in ranks[at + 1:] + ranks[:at] if r not in self.ctx.dropped)
        store.set(f"{key}/plan", f"{src},{adopter}")

    def _wait_key(self, store, key: str, sender: int | None = None) -> str:
        """A key of the store, once set (by `sender`, which the job may lose meanwhile: then an error naming it)."""
        while not store.check([key]):
            if sender is not None and sender in self.ctx.dropped:
                raise RuntimeError(f"{self.ctx.describe(sender)}, which held the newest values of a lost PS shard, "
                                   "was lost before it sent them")
            time.sleep(HEARTBEAT_S / 5)
        return store.get(key).decode()

    def _push_pull(self, grads: list[torch.Tensor]) -> tuple[int, int]:
        """Push to every shard; returns (images applied, flags). When some shard announced a
        sync point and another answered before reaching it, PULL that one's values of the point,
        so this node leaves the point with every shard's values of it."""
        asked = self.ctx.requests  # a stop signal or timed checkpoint: the shards' next update is a sync point
        if self.ctx.pipe_group is not None:  # every stage's shards make the same update a sync point
            bits = torch.tensor([asked & CHECKPOINT, asked & STOP], dtype=torch.int64, device=self.params[0].device)
            dist.all_reduce(bits, op=dist.ReduceOp.MAX, group=self.ctx.pipe_group)  # collective over the stages
            asked = int(bits[0]) | int(bits[1])  # host-device sync on a GPU, before the push's own
        payloads = [self._payload(grads, k) for k in range(len(self.servers))]
        if self.on_gpu:
            torch.cuda.current_stream().synchronize()  # host-device sync: the payloads' copies, once a step
        hdrs = self._exchange([(k, P.header(self.versions[k], P.PUSH, asked), payloads[k])
                               for k in range(len(self.servers))])
        behind = [k for k, h in enumerate(hdrs) if not int(h[1]) & P.SYNC]
        if len(behind) < len(hdrs):
            for k, h in zip(behind, self._exchange([(k, P.header(0, P.PULL), None) for k in behind])):
                hdrs[k] = h
        return int(hdrs[0][2]), int(hdrs[0][1])

    def _payload(self, grads: list[torch.Tensor], k: int) -> torch.Tensor:
        """Shard k's slice of the gradient, gathered on the replica's device straight into the wire's
        type (strategy.compression); from a GPU, then one copy into pinned host memory, queued."""
        g, n = grads[0], self.layout.numel(k)
        flat = gather(grads, self.layout.shards[k], self.buffer(f"push {k}", n, self.wire or g.dtype, g.device))
        if not self.on_gpu:
            return flat
        host = self.buffer(f"push {k} on host", n, flat.dtype, torch.device("cpu"), pin=True)
        return host.copy_(flat, non_blocking=True)

    def snapshot(self) -> dict:
        """Every shard's version, values, images and optimizer state. Asked at a
        sync point, while every other worker waits for the chief: each shard holds
        the point's values, which every worker has too."""
        keys, shards = state_keys(self.cfg.optim), []
        for k, numel in enumerate(self._shard_numels()):  # every shard, of every stage
            # with stages, this stage's shards are some of them (never taken on: survive_loss refuses stages)
            server, tags = (self.servers[k], self.tags[k]) if self.stage_numels is None else \
                (self.ctx.plan.ps[k].rank, P.Tags())
            hdr = torch.zeros(P.HEADER, dtype=torch.int64)
            p2p.send(P.header(0, P.SNAPSHOT), dst=server, tag=tags.hdr)
            p2p.recv(hdr, src=server, tag=tags.snap)
            tensors = [torch.empty(numel) for _ in range(1 + int(hdr[1]))]
            for t in tensors:
                p2p.recv(t, src=server, tag=tags.snap)
            shards.append({"version": int(hdr[0]), "images": int(hdr[2]), "values": tensors[0],
                           "optimizer": dict(zip(keys, tensors[1:]))})
        return {"ps": shards}

    def set_stages(self, numels: list[list[int]]) -> None:
        self.stage_numels = numels

    def _shard_numels(self) -> list[int]:
        """The values each PS shard holds, in shard order: with stages, each stage's layout of its parameters."""
        if self.stage_numels is None:
            return [self.layout.numel(k) for k in range(len(self.servers))]
        out = []
        for k in range(self.cfg.cluster.num_ps):
            s = k % self.cfg.parallel.stages
            mine = stage_shards(self.cfg, s)
            out.append(make_layout(self.stage_numels[s], len(mine), self.cfg.cluster.sharding).numel(mine.index(k)))
        return out

    def restore(self, state: dict) -> None:
        shards = state.get("ps") or []
        if len(shards) != self.cfg.cluster.num_ps:
            raise CheckpointError(f"the checkpoint holds {len(shards)} PS shards; this run has "
                                  f"{self.cfg.cluster.num_ps}")
        shards = [shards[k] for k in self.shards]  # this stage's
        for k, shard in enumerate(shards):
            scatter_(self.params, self.layout.shards[k], shard["values"])
        self.versions = [shard["version"] for shard in shards]
        super().restore(state)

    def finish(self, stopped: int = 0) -> None:
        if self.pusher:
            for server, tags in zip(self.servers, self.tags):
                if server not in self.ctx.dropped:  # (a shard lost as the job ended, never taken on)
                    p2p.send(P.header(0, P.STOP, stopped), dst=server, tag=tags.hdr)

    def healed(self, k: int) -> dict | None:
        """The k-th loss: a lost shard's, once taken on (the chief's record: where, at which version, the
        optimizer state's updates lost, seconds from its failed exchange to the exchange redone); {} for
        pushers, which the shards go on without."""
        ranks = self.ctx.dropped_at[k][0]
        if all(self.ctx.plan.procs[r].role != "ps" for r in ranks):
            return {}
        done = [b for b in self.rebuilds if b["ranks"][0] in ranks]
        return {key: v for b in done for key, v in b.items() if key != "ranks"} if done else None
