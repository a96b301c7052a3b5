"""Optimizers, the regularised loss and learning-rate schedules."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.optim.adamw import adamw as adamw_update  # torch's AdamW step, as a function

from .errors import ConfigError
from .imports import import_path, one_line


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


class Decoupled(torch.optim.Optimizer):
    """What AdamW, Lars and Lamb share: weight decay applied by the optimizer, not the loss (decoupled,
    Loshchilov & Hutter 2019), and parameters excluded from it and from the trust ratio: biases and
    normalisation parameters, ndim <= 1 unless `excluded` says (one flag a parameter, for a PS shard's
    1-D segments of layers). One param group; its "step" counts the steps (the bias corrections' t), so
    every state tensor is a parameter's shape: what the PS and the pipeline stages send."""

    STATE: tuple[str, ...] = ()
    LAYERWISE = False  # whether a step takes each parameter's norms: a PS shard then needs whole ones

    def __init__(self, params, defaults: dict, excluded: list[bool] | None) -> None:
        super().__init__(params, {**defaults, "step": 0})
        if len(self.param_groups) != 1:
            raise ValueError(f"{type(self).__name__} takes one list of parameters, not param groups")
        ps = self.param_groups[0]["params"]
        flags = excluded if excluded is not None else [p.ndim <= 1 for p in ps]
        if len(flags) != len(ps):
            raise ValueError(f"excluded has {len(flags)} flags for {len(ps)} parameters")
        self._excluded = {id(p) for p, x in zip(ps, flags) if x}

    @classmethod
    def keys(cls, momentum: float) -> tuple[str, ...]:
        """The state tensors kept for each parameter (optim.state_keys)."""
        return cls.STATE

    def excluded(self, p: torch.Tensor) -> bool:
        return id(p) in self._excluded

    def _stepping(self, group: dict) -> list[torch.Tensor]:
        """The group's parameters with a gradient, their state made on the first step; counts the step."""
        params = [p for p in group["params"] if p.grad is not None]
        for p in params:
            if not self.state[p]:
                self.state[p].update({k: torch.zeros_like(p) for k in self.keys(group.get("momentum", 1))})
        group["step"] += 1
        return params


class Moments(Decoupled):
    """What AdamW and Lamb share: Adam's two moments of the gradient, betas and eps (by default the
    class's EPS, each paper's own)."""

    STATE = ("exp_avg", "exp_avg_sq")
    EPS = 1e-8

    def __init__(self, params, lr: float, betas=(0.9, 0.999), eps: float | None = None, weight_decay: float = 0.01,
                 excluded: list[bool] | None = None) -> None:
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=self.EPS if eps is None else eps,
                                      weight_decay=weight_decay), excluded)


class AdamW(Moments):
    """torch's AdamW update (its multi-tensor kernel: torch.optim.adamw.adamw with foreach), weight
    decay left out for the excluded parameters: timm's default of no decay on biases and norms."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            params = self._stepping(group)
            (b1, b2), t = group["betas"], group["step"]
            for wd, part in ((group["weight_decay"], [p for p in params if not self.excluded(p)]),
                             (0.0, [p for p in params if self.excluded(p)])):
                if not part:
                    continue
                # torch counts steps per parameter and adds one first: a fresh count of t - 1 each.
                steps = [torch.tensor(float(t - 1)) for _ in part]
                adamw_update(part, [p.grad for p in part], [self.state[p]["exp_avg"] for p in part],
                             [self.state[p]["exp_avg_sq"] for p in part], [], steps, foreach=True, amsgrad=False,
                             beta1=b1, beta2=b2, lr=group["lr"], weight_decay=wd, eps=group["eps"], maximize=False)


def trust(w_norm: torch.Tensor, u_norm: torch.Tensor, ratio: torch.Tensor) -> torch.Tensor:
    """The trust ratio, 1 where either norm is 0 (a layer at zero, or no update), as timm's Lars and
    Lamb. 0-d tensors throughout: no host-device sync."""
    one = torch.ones_like(ratio)
    return torch.where(w_norm > 0, torch.where(u_norm > 0, ratio, one), one)


class Lars(Decoupled):
    """LARS (You et al. 2017) as timm's Lars: for each layer not excluded, the gradient plus wd * w is
    scaled by trust_coefficient * |w| / (|g| + wd |w| + eps), then momentum (dampening 0) and the step.
    Excluded parameters take plain momentum SGD, no decay. Adapted whatever the decay, as the paper."""

    STATE = ("momentum_buffer",)
    LAYERWISE = True

    def __init__(self, params, lr: float, momentum: float = 0.9, weight_decay: float = 0.0,
                 trust_coefficient: float = 0.001, eps: float = 1e-8, excluded: list[bool] | None = None) -> None:
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay,
                                      trust_coefficient=trust_coefficient, eps=eps), excluded)

    @classmethod
    def keys(cls, momentum: float) -> tuple[str, ...]:
        return cls.STATE if momentum else ()

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            params = self._stepping(group)
            wd, mu, tc, eps = group["weight_decay"], group["momentum"], group["trust_coefficient"], group["eps"]
            for p in params:
                g = p.grad
                if not self.excluded(p):
                    w_norm, g_norm = torch.linalg.vector_norm(p), torch.linalg.vector_norm(g)
                    ratio = trust(w_norm, g_norm, tc * w_norm / (g_norm + wd * w_norm + eps))
                    g = g.add(p, alpha=wd).mul_(ratio)
                if mu:
                    g = self.state[p]["momentum_buffer"].mul_(mu).add_(g)
                p.add_(g, alpha=-group["lr"])


class Lamb(Moments):
    """LAMB (You et al. 2019) as timm's Lamb without its gradient clipping: Adam's bias-corrected step
    m_hat / (sqrt(v_hat) + eps), plus wd * w, scaled for each layer not excluded by |w| / |update|.
    Excluded parameters take the Adam step alone, no decay."""

    EPS = 1e-6
    LAYERWISE = True

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            params = self._stepping(group)
            if not params:
                continue
            (b1, b2), t, wd = group["betas"], group["step"], group["weight_decay"]
            m, v = [self.state[p]["exp_avg"] for p in params], [self.state[p]["exp_avg_sq"] for p in params]
            grads = [p.grad for p in params]
            torch._foreach_mul_(m, b1)
            torch._foreach_add_(m, grads, alpha=1 - b1)
            torch._foreach_mul_(v, b2)
            torch._foreach_addcmul_(v, grads, grads, value=1 - b2)
            denom = torch._foreach_sqrt(v)
            torch._foreach_div_(denom, math.sqrt(1 - b2 ** t))
            torch._foreach_add_(denom, group["eps"])
            updates = torch._foreach_div(m, denom)
            torch._foreach_div_(updates, 1 - b1 ** t)
            for p, u in zip(params, updates):
                if not self.excluded(p):
                    u.add_(p, alpha=wd)
                    w_norm, u_norm = torch.linalg.vector_norm(p), torch.linalg.vector_norm(u)
                    u.mul_(trust(w_norm, u_norm, w_norm / u_norm))
                p.add_(u, alpha=-group["lr"])


# The optimizers that decay the weights themselves and leave biases and norms out: optim.name -> class.
LAYERED = {"adamw": AdamW, "lars": Lars, "lamb": Lamb}



def build_optimizer(cfg, params, excluded: list[bool] | None = None) -> torch.optim.Optimizer:
    """The recipe's optimizer over `params`. sgd and rmsprop-tf get no weight decay: it is the loss's L2
    term (loss_decay). adamw, lars and lamb decay the weights themselves (decoupled) and leave biases and
    normalisation parameters (ndim <= 1) out of the decay and of the trust ratio; `excluded` says which
    params those are where the shapes cannot (a PS shard's 1-D segments). A class of the user's,
    optim.name = package.module:Class, is called as Class(params, lr=optim.lr, **optim.args)."""
    o, params = cfg, list(params)
    if o.name in LAYERED:
        kw = dict(lr=o.lr, weight_decay=o.weight_decay, excluded=excluded)
        if o.name == "lars":
            return Lars(params, momentum=o.momentum, trust_coefficient=o.trust_coefficient, eps=o.adaptive_eps, **kw)
        return LAYERED[o.name](params, betas=(o.beta1, o.beta2), eps=o.adaptive_eps, **kw)
    if is_class_path(o.name):
        return _user_optimizer(o, params)
    if o.name == "rmsprop-tf":
        return RMSpropTF(params, o.lr, o.decay, o.eps, o.momentum)
    return torch.optim.SGD(params, lr=o.lr, momentum=o.momentum, foreach=True)  # multi-tensor kernels, on CPU too


def is_class_path(name: str) -> bool:
    """Whether optim.name names a class of the user's (package.module:Class), not a built-in optimizer."""
    return ":" in name


def loss_decay(cfg) -> float:
    """The weight of the loss's L2 term: optim.weight_decay, but 0 under adamw, lars and lamb, which apply
    it in the optimizer (decoupled). One rule for every loss, so that no weight is decayed twice."""
    return 0.0 if cfg.name in LAYERED else cfg.weight_decay


def _user_optimizer(o, params) -> torch.optim.Optimizer:
    """Class(params, lr=optim.lr, **optim.args); a ConfigError of one line naming optim.name when the class
    does not import, its call raises or it makes no torch optimizer."""
    cls = import_path("optim.name", o.name)
    call = f"{o.name}(params, lr={o.lr}{''.join(f', {k}={v!r}' for k, v in o.args.items())})"
    try:
        opt = cls(params, lr=o.lr, **o.args)
    except Exception as e:  # noqa: BLE001 - the user's code: any error is its message, in one line
        raise ConfigError(f"optim.name = {o.name!r}: {call} raised {one_line(e)}") from None
    if not isinstance(opt, torch.optim.Optimizer):
        raise ConfigError(f"optim.name = {o.name!r}: {call} returned a {type(opt).__name__}, not a "
                          "torch.optim.Optimizer")
    return opt


_PROBED: dict[tuple, tuple[tuple[str, ...], tuple[str, ...]]] = {}


def probe(cfg) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """What a class of the user's keeps for a parameter once it has stepped: (the names of its state
    tensors of the parameter's shape, the names of its 0-d ones such as a step count). Nothing but a step
    can tell, so it takes one over a 3x2 parameter, on CPU; kept by name and args, so that a checkpoint
    does not step it again. Also the check that the class builds and steps (ConfigError otherwise)."""
    key = (cfg.name, repr(sorted(cfg.args.items())))
    if key not in _PROBED:
        p = torch.nn.Parameter(torch.ones(3, 2))
        opt = _user_optimizer(cfg, [p])
        p.grad = torch.full_like(p, 0.5)
        try:
            opt.step()
        except Exception as e:  # noqa: BLE001 - the user's code: any error is its message, in one line
            raise ConfigError(f"optim.name = {cfg.name!r}: its step() over a 3x2 parameter raised "
                              f"{one_line(e)}") from None
        st = {k: v for k, v in opt.state.get(p, {}).items() if torch.is_tensor(v)}
        _PROBED[key] = (tuple(k for k, v in st.items() if v.shape == p.shape),
                        tuple(k for k, v in st.items() if v.dim() == 0))
    return _PROBED[key]


def state_keys(cfg) -> tuple[str, ...]:
    """Names of the per-parameter state tensors build_optimizer's optimizer
    keeps once it has stepped, each the parameter's shape. adamw and lamb count their
    steps in the param group, not per parameter, so that these are all their state."""
    if cfg.name in LAYERED:
        return LAYERED[cfg.name].keys(cfg.momentum)
    if is_class_path(cfg.name):
        return probe(cfg)[0]
    if cfg.name == "rmsprop-tf":
        return ("ms", "mom")
    return ("momentum_buffer",) if cfg.momentum else ()


def decayed(model: nn.Module) -> list[torch.Tensor]:
    """The tensors under L2 decay: weights of convolutions and linear layers
    (as TF-slim regularises them), not biases or normalisation scales."""
    return [p for p in model.parameters() if p.ndim > 1]


def loss_fn(logits: torch.Tensor, target: torch.Tensor, decayed_params: list[torch.Tensor],
            weight_decay: float) -> torch.Tensor:
    """Cross-entropy plus weight_decay/2 * sum of squares (TF's l2_loss). target: class indices, or
    class probabilities N x classes (mixing.py's soft targets: label smoothing, mixup, CutMix), each
    row's cross-entropy then -sum(p log softmax), as torch's cross_entropy computes for either."""
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
