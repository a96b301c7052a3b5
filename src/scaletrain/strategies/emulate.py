"""Asynchronous training emulated in one process: deterministic delayed gradients.

K asynchronous workers of equal speed take turns: each pulls the current
values, computes a gradient while the K-1 others each apply one, and pushes
it. So in steady state every gradient is applied K-1 updates after the
version it was computed on (the first K-1 are less stale: the run has no
older versions). Here one process computes every gradient on the parameters
of version max(0, v - (K-1)) and applies it to the current values, so a
study can explore 16-64 workers on one machine, exactly reproducibly.
K = 1 is plain training. strategy.staleness_lr and strategy.delay_compensation
act as on an asynchronous PS shard (ps/server.py), w_then being the version
the gradient was computed on. Memory: K + 1 copies of the parameters and the
optimizer state (and checkpoints hold all of them).

Asynchronous all-reduce (a strategy whose registry entry has `rounds`) is
emulated as K replicas whose rounds take one step: every update averages one
gradient of each replica, all computed on the values one update back (as
strategy.async_bound = 1 does with real processes). Here the K gradients are
K consecutive steps of the one process, on the same values; the update
follows the K-th.
"""

from __future__ import annotations

from collections import deque
from contextlib import contextmanager

import torch

from ..optim import build_optimizer, compensate, staleness_scale
from .base import Strategy, Tick

HIST_BINS = 64  # staleness 0..63: enough for strategy.emulate_workers <= 64


class EmulatedAsync(Strategy):
    def __init__(self, cfg, ctx, model, optimizer, schedule, workers: int, rounds: bool = False) -> None:
        super().__init__(cfg, ctx, model, optimizer, schedule)
        self.k = workers
        # versions a gradient is behind in steady state, and gradients an update averages
        self.delay, self.per_update = (min(1, workers - 1), workers) if rounds else (workers - 1, 1)
        self.current = [p.detach().clone() for p in self.params]  # the server's values
        self.server_opt = build_optimizer(cfg.optim, self.current)
        self.history = deque([[c.clone() for c in self.current]], maxlen=self.delay + 1)  # the last versions
        self.summed: list[torch.Tensor] = []  # rounds: the gradients of the update under way, summed
        self.gathered = 0
        self.version = 0
        self.hist = [0] * HIST_BINS
        self.staleness_lr, self.dc = cfg.strategy.staleness_lr, cfg.strategy.delay_compensation

    def step(self, lr: float) -> Tick:
        self.counters.steps += 1
        grads = self._gather(self.grads())
        if grads is None:  # the update under way needs more gradients, on the same values
            return self.advance(self.schedule.step_images)
        # The gradient was computed on history[0] (loaded after the last update): the oldest version kept.
        staleness = len(self.history) - 1
        self.hist[min(staleness, HIST_BINS - 1)] += self.per_update
        for c, g, then in zip(self.current, grads, self.history[0]):
            if self.dc:
                compensate(g, c, then, self.dc)
            c.grad = g
        for group in self.server_opt.param_groups:
            group["lr"] = lr * staleness_scale(self.staleness_lr, staleness)
        self.server_opt.step()
        self.version += 1
        self.history.append([c.clone() for c in self.current])
        self._load(self.history[0])  # the next gradient is computed on version max(0, v - delay)
        return self.advance(self.schedule.step_images)

    def _gather(self, grads: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """The gradients to apply now: these, or the mean of the last per_update steps' once
        there are that many (None before)."""
        if self.per_update == 1:
            return grads
        if self.summed:
            torch._foreach_add_(self.summed, grads)
        else:
            self.summed = [g.detach().clone() for g in grads]
        self.gathered += 1
        if self.gathered < self.per_update:
            return None
        mean, self.summed, self.gathered = torch._foreach_div(self.summed, self.per_update), [], 0
        return mean

    def _load(self, values: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for p, v in zip(self.params, values):
                p.copy_(v)

    @contextmanager
    def latest(self):
        """The current values in the model (for evaluation and checkpoints), then back."""
        stale = [p.detach().clone() for p in self.params]
        self._load(self.current)
        try:
            yield
        finally:
            self._load(stale)

    def finish(self, stopped: int = 0) -> None:
        self._load(self.current)

    def snapshot(self) -> dict:
        return {"emulator": {"version": self.version, "history": list(self.history), "hist": list(self.hist),
                             "optimizer": self.server_opt.state_dict(), "summed": list(self.summed),
                             "gathered": self.gathered}}

    def restore(self, state: dict) -> None:
        super().restore(state)
        e = state["emulator"]
        self.version, self.hist = e["version"], list(e["hist"])
        on = self.current[0].device  # a checkpoint is read onto the CPU; these live where the model does
        self.summed, self.gathered = [t.to(on) for t in e.get("summed", [])], e.get("gathered", 0)
        self.history = deque([[t.to(on) for t in v] for v in e["history"]], maxlen=self.delay + 1)
        with torch.no_grad():
            for c, v in zip(self.current, self.history[-1]):
                c.copy_(v)
        self.server_opt.load_state_dict(e["optimizer"])
        self._load(self.history[0])

    def stats(self) -> dict:
        n = sum(self.hist)
        mean = sum(i * c for i, c in enumerate(self.hist)) / n if n else 0.0
        return {"emulated_workers": self.k, "gradients_per_update_mean": float(self.per_update),
                "staleness_mean": mean,
                "staleness_max": max((i for i, c in enumerate(self.hist) if c), default=0),
                "staleness_hist": self.hist}
