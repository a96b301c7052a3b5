"""The parameter-server loop of one shard.

The shard holds its slice of the parameters as one flat tensor, with the
optimizer state for it, and a version counter (updates applied). Staleness
of a gradient = shard version when applied - version it was computed on.

- sync: gradients of the current version are summed until `wait_for` of the
  still-active pushers have sent theirs (all of them; N-b with backup
  workers); their mean is applied and every contributor gets the new values.
  A gradient computed on an older version is dropped, counted, and its
  sender gets the current values at once.
- async: each gradient is applied as it arrives and its sender gets the
  current values back; no pusher waits for another.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from ..models import build_model
from ..optim import build_optimizer, lr_at
from . import protocol as P
from .sharding import gather, make_layout

log = logging.getLogger("scaletrain")
HIST_BINS = 64  # staleness histogram: bins 0..62, the last holds 63 and above


class Shard:
    def __init__(self, cfg, index: int, pushers: list[int], mode: str, wait_for: int, total_steps: int) -> None:
        torch.manual_seed(cfg.train.seed)  # the workers' initial model, bit for bit
        params = list(build_model(cfg.model).parameters())
        self.layout = make_layout([p.numel() for p in params], cfg.cluster.num_ps, cfg.cluster.sharding)
        self.values = torch.nn.Parameter(gather(params, self.layout.shards[index]).clone())
        self.optimizer = build_optimizer(cfg.optim, [self.values])
        self.cfg, self.index, self.mode, self.wait_for, self.total = cfg, index, mode, wait_for, total_steps
        self.pushers, self.active = list(pushers), set(pushers)
        self.version = 0
        self.hist = torch.zeros(HIST_BINS, dtype=torch.int64)
        self.stale_max, self.dropped, self.applied = 0, 0, 0
        self.by_sender = {r: [0, 0] for r in pushers}  # staleness sum and count of each pusher
        self.bytes_sent = self.bytes_recv = 0
        self.pending: list[int] = []  # sync: senders whose gradient is in `acc`
        self.acc = torch.zeros_like(self.values)

    def serve(self) -> None:
        hdr, grad = torch.zeros(P.HEADER, dtype=torch.int64), torch.empty_like(self.values)
        while self.active:
            src = dist.recv(hdr, tag=P.TAG_HDR)  # point-to-point from any pusher; blocks
            version, command = int(hdr[0]), int(hdr[1])
            self.bytes_recv += P.HEADER * 8
            if command == P.STOP:
                self.active.discard(src)
                self._maybe_apply()
                continue
            dist.recv(grad, src=src, tag=P.TAG_VALS)
            self.bytes_recv += grad.numel() * grad.element_size()
            if self.mode == "async":
                self._record(src, self.version - version)
                self._apply(grad, step=self.version // len(self.pushers))
                self._reply([src])
            elif version == self.version:
                self.acc += grad
                self.pending.append(src)
                self._maybe_apply()
            else:  # computed on a version already applied: too late
                self.dropped += 1
                self._reply([src])

    def _maybe_apply(self) -> None:
        if self.pending and len(self.pending) >= min(self.wait_for, len(self.active)):
            for src in self.pending:
                self._record(src, 0)
            self._apply(self.acc / len(self.pending), step=self.version)
            self.acc.zero_()
            senders, self.pending = self.pending, []
            self._reply(senders)

    def _apply(self, grad: torch.Tensor, step: int) -> None:
        for g in self.optimizer.param_groups:
            g["lr"] = lr_at(self.cfg.optim, step, self.total)
        self.values.grad = grad
        self.optimizer.step()
        self.version += 1
        self.applied += 1

    def _record(self, src: int, staleness: int) -> None:
        self.hist[min(staleness, HIST_BINS - 1)] += 1
        self.by_sender[src][0] += staleness
        self.by_sender[src][1] += 1
        self.stale_max = max(self.stale_max, staleness)

    def _reply(self, dsts: list[int]) -> None:
        vals = self.values.detach()
        for dst in dsts:
            # The pusher posted its receives before pushing, so these do not wait on it.
            dist.send(P.header(self.version, 0), dst=dst, tag=P.TAG_REPLY_HDR)
            dist.send(vals, dst=dst, tag=P.TAG_REPLY_VALS)
            self.bytes_sent += P.HEADER * 8 + vals.numel() * vals.element_size()
