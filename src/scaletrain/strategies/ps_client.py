"""The worker side of the parameter-server strategies (sync, mixed-async, async, backup).

Per step: average inside the node (unless every replica pushes on its own),
then the pusher sends to each PS shard its slice of the gradient tagged with
the shard version it was computed on, receives the shard's current values,
and shares them inside the node. What the shard does with the gradient
(wait for all nodes, for the first N-b, or apply at once) is the server's
mode; this side is the same for all four.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ..checkpoint import CheckpointError
from ..optim import state_keys
from ..ps import protocol as P
from ..ps.sharding import gather, make_layout, scatter_
from .allreduce import average_
from .base import Strategy


class PSClient(Strategy):
    def __init__(self, cfg, ctx, model, optimizer, per_node: bool) -> None:
        super().__init__(cfg, ctx, model, optimizer)
        self.per_node = per_node
        self.group = ctx.node_group if per_node else None
        self.group_size = len(ctx.node_workers()) if per_node else 1
        self.pusher = not per_node or ctx.me.replica == 0
        self.leader = ctx.node_workers()[0] if per_node else ctx.rank
        self.layout = make_layout([p.numel() for p in self.params], cfg.cluster.num_ps, cfg.cluster.sharding)
        self.servers = [p.rank for p in ctx.plan.ps]
        self.versions = [0] * len(self.servers)

    def step(self, lr: float) -> None:
        grads = self.grads()
        if self.group is not None:
            average_(grads, self.group, self.group_size, self.counters, "intra_s")
        if self.pusher:
            with self.counters.timed("comm_s"):
                self._push_pull([g.detach().cpu() for g in grads])
        if self.group is not None:
            flat = _flatten_dense_tensors([p.data for p in self.params])
            with self.counters.timed("intra_s"):
                dist.broadcast(flat, src=self.leader, group=self.group)  # collective: leader's new values
            if self.pusher:
                self.counters.intra_bytes += flat.numel() * flat.element_size()
            for p, v in zip(self.params, _unflatten_dense_tensors(flat, self.params)):
                p.data.copy_(v)
        self.counters.steps += 1

    def _push_pull(self, grads: list[torch.Tensor]) -> None:
        replies, works = [], []
        for k, server in enumerate(self.servers):
            n = self.layout.numel(k)
            hdr, vals = torch.zeros(P.HEADER, dtype=torch.int64), torch.empty(n)
            # Post the receives first: the server answers as soon as it has applied.
            works += [dist.irecv(hdr, src=server, tag=P.TAG_REPLY_HDR),
                      dist.irecv(vals, src=server, tag=P.TAG_REPLY_VALS)]
            replies.append((hdr, vals))
            out = gather(grads, self.layout.shards[k])
            works += [dist.isend(P.header(self.versions[k], P.PUSH), dst=server, tag=P.TAG_HDR),
                      dist.isend(out, dst=server, tag=P.TAG_VALS)]
            self.counters.bytes_sent += P.HEADER * 8 + out.numel() * out.element_size()
        for w in works:
            w.wait()  # point-to-point; returns when the shard has answered
        device = self.params[0].device
        cpu_params = [p.detach().cpu() for p in self.params] if device.type != "cpu" else self.params
        for k, (hdr, vals) in enumerate(replies):
            self.versions[k] = int(hdr[0])
            self.counters.bytes_recv += P.HEADER * 8 + vals.numel() * vals.element_size()
            scatter_(cpu_params, self.layout.shards[k], vals)
        if device.type != "cpu":
            with torch.no_grad():
                for p, c in zip(self.params, cpu_params):
                    p.copy_(c, non_blocking=True)

    def snapshot(self) -> dict:
        """Every shard's version, values and optimizer state. Asked between two of
        this pusher's steps: under sync (all nodes' gradients per version) no shard
        can pass the version this node has not pushed yet, so all shards are at the
        same step; under backup and the asynchronous modes each shard is taken as
        the request finds it."""
        keys, shards = state_keys(self.cfg.optim), []
        for k, server in enumerate(self.servers):
            hdr = torch.zeros(P.HEADER, dtype=torch.int64)
            dist.send(P.header(0, P.SNAPSHOT), dst=server, tag=P.TAG_HDR)
            dist.recv(hdr, src=server, tag=P.TAG_SNAP)
            tensors = [torch.empty(self.layout.numel(k)) for _ in range(1 + int(hdr[1]))]
            for t in tensors:
                dist.recv(t, src=server, tag=P.TAG_SNAP)
            shards.append({"version": int(hdr[0]), "values": tensors[0],
                           "optimizer": dict(zip(keys, tensors[1:]))})
        return {"ps": shards}

    def restore(self, state: dict) -> None:
        shards = state.get("ps") or []
        if len(shards) != len(self.servers):
            raise CheckpointError(f"the checkpoint holds {len(shards)} PS shards; this run has {len(self.servers)}")
        for k, shard in enumerate(shards):
            scatter_(self.params, self.layout.shards[k], shard["values"])
        self.versions = [shard["version"] for shard in shards]

    def finish(self) -> None:
        if self.pusher:
            for server in self.servers:
                dist.send(P.header(0, P.STOP), dst=server, tag=P.TAG_HDR)
