"""A parameter-server shard's optimizer: the recipe's [optim] over the shard's flat slice of the
parameters, its state laid out as the values are, so that a snapshot is tensors of the shard's size.

adamw, lars and lamb step each layer's piece as a parameter of its own (a view of the values), so
that a layer's norms and its exclusion from decay are its own (ps/sharding.py: Piece); sgd,
rmsprop-tf (elementwise) and a class of the user's step the one flat slice.
"""

from __future__ import annotations

import torch

from ..errors import CheckpointError, ConfigError
from ..optim import LAYERED, build_optimizer, is_class_path, probe, state_keys
from .sharding import Piece


class ShardOptimizer:
    """The recipe's [optim] over one shard's values (the module doc)."""

    def __init__(self, cfg, values: torch.nn.Parameter, parts: tuple[Piece, ...]) -> None:
        """A layer cut between shards has norms no shard can take: refused for lars and lamb."""
        o, self.cfg, self.values = cfg.optim, cfg, values
        if o.name not in LAYERED or not parts:
            self.stepped, self.spans, excluded = [values], [(0, values.numel())], None
        elif LAYERED[o.name].LAYERWISE and not all(q.whole for q in parts):
            raise ConfigError(f"optim.name = {o.name!r} scales each layer by its norms, and cluster.sharding = "
                              f"{cfg.cluster.sharding!r} cuts layers between the {cfg.cluster.num_ps} PS shards: set "
                              "cluster.sharding = 'round-robin' (whole tensors on each shard)")
        else:  # views share the values' memory
            self.stepped = [torch.nn.Parameter(values.detach()[q.offset:q.offset + q.size]) for q in parts]
            self.spans, excluded = [(q.offset, q.size) for q in parts], [q.excluded for q in parts]
        self.optimizer = build_optimizer(o, self.stepped, excluded)

    def step(self, grad: torch.Tensor, lr: float) -> None:
        """Apply `grad`, a gradient of the shard's size, at learning rate `lr`."""
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        for t, (a, n) in zip(self.stepped, self.spans):  # views: no copy
            t.grad = grad if t is self.values else grad[a:a + n]
        self.optimizer.step()

    def state(self) -> list[torch.Tensor]:
        """The state tensors (optim.state_keys' order), each the shard's size; none before the first update."""
        sts = [self.optimizer.state.get(t, {}) for t in self.stepped]
        if not sts or not sts[0]:
            return []
        return [sts[0][k] if len(sts) == 1 else torch.cat([st[k] for st in sts]) for k in state_keys(self.cfg.optim)]

    def load(self, saved: dict[str, torch.Tensor], version: int) -> None:
        """Put back the state of a snapshot taken at `version` (updates applied). A step count is no tensor
        of the shard's size, so the snapshot has none: it is the version (one optimizer step an update).
        adamw and lamb keep it in the param group; a class of the user's may keep a 0-d "step" a
        parameter, as torch's do. Other 0-d state cannot be restored."""
        for t, (a, n) in zip(self.stepped, self.spans):
            self.optimizer.state[t] = {k: v[a:a + n].clone() for k, v in saved.items()}
        for group in self.optimizer.param_groups:
            if "step" in group:
                group["step"] = version
        if not is_class_path(self.cfg.optim.name):
            return
        scalars = probe(self.cfg.optim)[1]
        if set(scalars) - {"step"}:
            raise CheckpointError(f"optim.name = {self.cfg.optim.name!r} keeps 0-d state "
                                  f"{sorted(set(scalars) - {'step'})} that a PS shard's snapshot does not hold")
        for t in self.stepped:
            self.optimizer.state[t].update({k: torch.tensor(float(version)) for k in scalars})
