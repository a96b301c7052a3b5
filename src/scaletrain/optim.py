"""Optimizers, the regularised loss and learning-rate schedules."""

from __future__ import annotations

import math

import torch
from torch import nn


class RMSpropTF(torch.optim.Optimizer):
    """RMSProp as TensorFlow 1.x computes it.

        ms  <- decay * ms + (1 - decay) * g^2        (ms starts at 1.0, not 0)
        mom <- momentum * mom + lr * g / sqrt(ms + eps)
        p   <- p - mom

    torch.optim.RMSprop differs on both points: its accumulator starts at 0
    and its epsilon sits outside the square root, which with the study's
    eps = 1.0 gives very different first steps.
    """

    def __init__(self, params, lr: float, decay: float = 0.9, eps: float = 1.0, momentum: float = 0.0) -> None:
        super().__init__(params, dict(lr=lr, decay=decay, eps=eps, momentum=momentum))

    @torch.no_grad()
    def step(self, closure=None):
        """One pass of multi-tensor kernels (torch._foreach_*) over each group: a handful of
        kernels a step instead of five per parameter (about 800 tensors for ResNet-50)."""
        for group in self.param_groups:
            lr, decay, eps, mu = group["lr"], group["decay"], group["eps"], group["momentum"]
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            for p in params:
                if not self.state[p]:
                    self.state[p].update(ms=torch.ones_like(p), mom=torch.zeros_like(p))
            grads = [p.grad for p in params]
            ms, mom = [self.state[p]["ms"] for p in params], [self.state[p]["mom"] for p in params]
            torch._foreach_mul_(ms, decay)
            torch._foreach_addcmul_(ms, grads, grads, value=1 - decay)
            denom = torch._foreach_add(ms, eps)
            torch._foreach_sqrt_(denom)
            torch._foreach_mul_(mom, mu)
            torch._foreach_addcdiv_(mom, grads, denom, value=lr)
            torch._foreach_sub_(params, mom)


def build_optimizer(cfg, params) -> torch.optim.Optimizer:
    """Weight decay is not given to the optimizer: it is part of the loss."""
    o = cfg
    if o.name == "rmsprop-tf":
        return RMSpropTF(params, o.lr, o.decay, o.eps, o.momentum)
    return torch.optim.SGD(params, lr=o.lr, momentum=o.momentum, foreach=True)  # multi-tensor kernels, on CPU too


def state_keys(cfg) -> tuple[str, ...]:
    """Names of the per-parameter state tensors build_optimizer's optimizer
    keeps once it has stepped, each the parameter's shape."""
    if cfg.name == "rmsprop-tf":
        return ("ms", "mom")
    return ("momentum_buffer",) if cfg.momentum else ()


def decayed(model: nn.Module) -> list[torch.Tensor]:
    """The tensors under L2 decay: weights of convolutions and linear layers
    (as TF-slim regularises them), not biases or normalisation scales."""
    return [p for p in model.parameters() if p.ndim > 1]


def loss_fn(logits: torch.Tensor, target: torch.Tensor, decayed_params: list[torch.Tensor],
            weight_decay: float) -> torch.Tensor:
    """Cross-entropy plus weight_decay/2 * sum of squares (TF's l2_loss)."""
    loss = nn.functional.cross_entropy(logits, target)
    if weight_decay and decayed_params:
        # One fused pass over all weights (about 25M values for ResNet-50),
        # small next to the forward pass.
        sq = torch.stack(torch._foreach_norm(decayed_params)).pow(2).sum()
        loss = loss + 0.5 * weight_decay * sq
    return loss


def peak_lr(cfg, update_images: int) -> float:
    """optim.lr scaled for `update_images` images per update, against optim.reference_batch: linear
    (Goyal et al. 2017), square root, none, or by the gradient noise scale N (noise): the gain
    (1 + N/B_ref) / (1 + N/B), which is how much further one update of B images goes than one of
    B_ref (McCandlish et al. 2018; AdaScale's gain, Johnson et al. 2020, at a fixed N): linear while
    B is well below N, levelling off above it. Under it an update of B images counts as that many
    of B_ref, which is what perfmodel/statistical.py predicts steps to a target with."""
    b, ref = update_images, cfg.reference_batch
    if cfg.scale_lr == "noise":
        return cfg.lr * (1 + cfg.noise_scale / ref) / (1 + cfg.noise_scale / b)
    return cfg.lr * {"none": 1.0, "linear": b / ref, "sqrt": math.sqrt(b / ref)}[cfg.scale_lr]


def lr_at(cfg, step: int, total: int, update_images: int) -> float:
    """Learning rate at job step `step` (0-based) of `total`: a pure function of the
    step, so a resumed run needs no scheduler state. Warm-up without scaling rises
    linearly from 0 to lr; with scaling up, from lr to the scaled lr (Goyal et al.)."""
    peak = peak_lr(cfg, update_images)
    if step < cfg.warmup_steps:
        if peak <= cfg.lr:  # no scaling, or scaled down: from 0
            return peak * (step + 1) / cfg.warmup_steps
        return cfg.lr + (peak - cfg.lr) * step / cfg.warmup_steps
    if cfg.schedule == "step":
        return peak * cfg.gamma ** ((step - cfg.warmup_steps) // cfg.step_size)
    if cfg.schedule == "cosine":
        span = max(1, total - cfg.warmup_steps)
        return 0.5 * peak * (1 + math.cos(math.pi * min(1.0, (step - cfg.warmup_steps) / span)))
    return peak


def staleness_scale(mode: str, staleness: int) -> float:
    """The learning-rate factor of a gradient `staleness` updates old: 1 / (staleness + 1)
    under strategy.staleness_lr = inverse (Zhang et al. 2016), else 1."""
    return 1.0 / (staleness + 1) if mode == "inverse" else 1.0


def compensate(grad: torch.Tensor, now: torch.Tensor, then: torch.Tensor, lam: float,
               buf: torch.Tensor | None = None) -> torch.Tensor:
    """DC-ASGD's delay compensation (Zheng et al. 2017), in place: grad, computed on the values
    `then`, becomes grad + lam * grad * grad * (now - then). `buf` (now's shape) saves an allocation."""
    d = torch.sub(now, then, out=buf) if buf is not None else now - then
    return grad.addcmul_(d.mul_(grad), grad, value=lam)
