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

A SNAPSHOT request (from the chief, for a checkpoint) is answered at once
with the version, the values and the optimizer state; `load` puts such a
snapshot back when a run resumes.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from ..checkpoint import CheckpointError
from ..models import build_model
from ..optim import build_optimizer, lr_at, state_keys
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
            if command == P.SNAPSHOT:
                self._send_state(src)
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

    def state(self) -> list[torch.Tensor]:
        """The values, then the optimizer state tensors (none before the first update)."""
        st = self.optimizer.state.get(self.values, {})
        return [self.values.detach()] + [st[k] for k in state_keys(self.cfg.optim) if st]

    def _send_state(self, dst: int) -> None:
        # Checkpoint traffic: not counted in the per-step bytes.
        tensors = self.state()
        dist.send(P.header(self.version, len(tensors) - 1), dst=dst, tag=P.TAG_SNAP)
        for t in tensors:
            dist.send(t, dst=dst, tag=P.TAG_SNAP)

    def load(self, saved: dict) -> None:
        """Continue from a snapshot of this shard (see PSClient.snapshot)."""
        values = saved["values"]
        if values.shape != self.values.shape:
            raise CheckpointError(f"the checkpoint holds {values.numel()} values for PS shard {self.index}, "
                             f"which has {self.values.numel()}")
        with torch.no_grad():
            self.values.copy_(values)
        if saved["optimizer"]:
            self.optimizer.state[self.values] = {k: v.clone() for k, v in saved["optimizer"].items()}
        self.version = saved["version"]

    def _reply(self, dsts: list[int]) -> None:
        vals = self.values.detach()
        for dst in dsts:
            # The pusher posted its receives before pushing, so these do not wait on it.
            dist.send(P.header(self.version, 0), dst=dst, tag=P.TAG_REPLY_HDR)
            dist.send(vals, dst=dst, tag=P.TAG_REPLY_VALS)
            self.bytes_sent += P.HEADER * 8 + vals.numel() * vals.element_size()
