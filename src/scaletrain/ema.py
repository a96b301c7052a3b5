"""An exponential moving average of the weights (train.ema_decay), as timm's ModelEmaV3 keeps it.

After every update this process applies (or pulls: parameter servers) the replica keeps

    ema = d * ema + (1 - d) * weights,   d = min(train.ema_decay, (1 + n) / (10 + n))

n being the updates averaged before this one. The warm-up of d (timm's) lets the average follow
the weights closely over the first updates, so that an early evaluation is not that of the
initial weights (with d = 0.999, 0.9 of the average would still be them after 100 updates).
Buffers (BatchNorm's running statistics) are copied, not averaged, as timm does: the average's
weights are evaluated with the statistics the weights have now.

Cost: one more copy of the weights on their device, and one fused pass over them a step
(torch._foreach_lerp_ and _foreach_copy_: a few kernels, no host-device sync). Evaluating the
average swaps its tensors into the model (no copy) and back.

With pipeline stages each process keeps the average of its own stage's tensors only, named as in
the whole model, so that a whole-model checkpoint's average loads into any stage.
"""

from __future__ import annotations

from contextlib import contextmanager
from itertools import chain

import torch

from .errors import CheckpointError


class Ema:
    """The average of `model`'s parameters that `own` holds (a pipeline stage; None: all of them),
    and a copy of its buffers, starting from their values now."""

    def __init__(self, decay: float, model: torch.nn.Module, own: torch.nn.Module | None = None) -> None:
        mine = {id(t) for t in chain((own or model).parameters(), (own or model).buffers())}
        params = [(n, p) for n, p in model.named_parameters() if id(p) in mine]
        buffers = [(n, b) for n, b in model.named_buffers() if id(b) in mine]
        self.decay, self.updates = decay, 0
        self.names = [n for n, _ in params] + [n for n, _ in buffers]
        self.params, self.buffers = [p for _, p in params], [b for _, b in buffers]
        with torch.no_grad():
            self.avg = [p.detach().clone() for p in self.params]
            self.copies = [b.detach().clone() for b in self.buffers]

    def rate(self) -> float:
        """This update's d: the warm-up's (1 + n) / (10 + n) until it passes train.ema_decay."""
        return min(self.decay, (1 + self.updates) / (10 + self.updates))

    @torch.no_grad()
    def update(self) -> None:
        """Fold the weights in after an update: one fused pass on their device, queued (no host sync)."""
        if self.avg:
            torch._foreach_lerp_(self.avg, self.params, 1.0 - self.rate())  # ema += (1 - d) (w - ema)
        if self.copies:
            torch._foreach_copy_(self.copies, self.buffers)
        self.updates += 1

    @contextmanager
    def swapped(self):
        """The average in the model's own tensors (their storage exchanged, not copied), then back:
        for an evaluation or a gather of the average. Nothing may step the model meanwhile."""
        self._swap()
        try:
            yield
        finally:
            self._swap()

    def _swap(self) -> None:
        for live, kept in ((self.params, self.avg), (self.buffers, self.copies)):
            for i, t in enumerate(live):
                data = t.data
                t.data, kept[i] = kept[i], data

    def state_dict(self) -> dict:
        """The checkpoint's "ema": updates averaged and the tensors by their names in the model's
        state_dict (those of this process: a stage's own with stages)."""
        return {"updates": self.updates, "tensors": dict(zip(self.names, chain(self.avg, self.copies)))}

    @torch.no_grad()
    def load_state_dict(self, state: dict | None) -> None:
        """Continue from a checkpoint's "ema" (state_dict's, or a whole model's gathered from its stages)."""
        if not state:
            raise CheckpointError("the checkpoint holds no average of the weights (train.ema_decay): "
                                  "it was written without one")
        saved = state["tensors"]
        missing = [n for n in self.names if n not in saved]
        if missing:
            raise CheckpointError(f"the checkpoint's average of the weights lacks {missing[0]} "
                                  f"({len(missing)} tensors missing)")
        for n, t in zip(self.names, chain(self.avg, self.copies)):
            t.copy_(saved[n])
        self.updates = int(state["updates"])
