"""What a replica computes before each strategy step: its batch's gradient.

`Backprop` is the real thing: the next batch, forward and backward.
`Emulated` stands for a GPU (train.emulate_compute_s = T > 0): the host
sleeps T seconds, as a host does while its GPU computes, then every
parameter's .grad is filled with a fixed gradient of the model's size and
layout. Everything after (averaging, all-reduce, PS pushes and pulls, the
optimizer) is the strategy's real work, so a 2-core machine can show how the
communication and the PS of a GPU cluster scale. The train loop calls either
the same way, with the batch job.batches() gave (None for Emulated).
"""

from __future__ import annotations

import ctypes
import os
import time
from contextlib import nullcontext

import torch
from torch.nn.parallel import DistributedDataParallel

from . import metrics
from .optim import decayed, loss_decay, loss_fn

# Small enough that SGD and RMSProp stay finite over millions of steps of the same gradient.
EMULATED_SCALE = 1e-3
# glibc's mallopt parameters, and what keep_freed_memory sets them to: allocations below 32 MB come
# from the heap, and the heap keeps up to 1 GB free at its top instead of giving it back.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
HEAP_ALLOC_BYTES, HEAP_KEEP_BYTES = 32 << 20, 1 << 30


def keep_freed_memory() -> bool:
    """Keep the host memory a step frees for the next step instead of giving it back to the kernel.

    Every step allocates and frees the same activations and batches. By default glibc serves the
    larger ones with mmap and trims the heap's free top, so the next step faults in fresh zeroed
    pages, one per 4 KB: CPU replicas then spend a good share of the cores' time in the kernel.
    The cost: the peak of a step stays mapped, which the next step needs anyway. Left alone where
    the user set glibc's MALLOC_*_THRESHOLD_ variables; a preloaded allocator (jemalloc, tcmalloc)
    does not read these settings. Returns whether they were set."""
    if any(k in os.environ for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, HEAP_ALLOC_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD, HEAP_KEEP_BYTES))


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """The type forward passes autocast to at train.precision: bfloat16 for bf16 on CUDA; None (fp32)
    elsewhere, as the key documents (autocast on CUDA only)."""
    return torch.bfloat16 if precision == "bf16" and device.type == "cuda" else None


def autocast(precision: str, device: torch.device):
    """The context a forward pass runs in, training and evaluation alike."""
    dtype = autocast_dtype(precision, device)
    return torch.autocast(device.type, dtype=dtype) if dtype is not None else nullcontext()


def autocast_calls(module: torch.nn.Module, dtype: torch.dtype, device_type: str) -> None:
    """Make every call of `module` run its forward under torch.autocast(device_type, dtype), so that a
    loop's own `model(x)` runs at train.precision without a context of its own. The backward, which
    torch's AMP docs keep out of autocast, stays out. Hooks, not a wrapper module: the module a loop
    gets keeps its type and state_dict names. On a torch.compile'd module they run eagerly, outside
    the compiled frame, which then traces the forward under autocast as `with autocast: model(x)`."""
    entered: list = []  # a stack: a module may call itself (a recursive or shared block)

    def enter(mod, args) -> None:
        ctx = torch.autocast(device_type, dtype=dtype)
        ctx.__enter__()
        entered.append(ctx)

    def leave(mod, args, out) -> None:
        entered.pop().__exit__(None, None, None)

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave, always_call=True)  # left even when the forward raises


def keep_bucket_views(optimizer: torch.optim.Optimizer, *modules: torch.nn.Module) -> bool:
    """Where the gradients are views of DDP's buckets (grads_to_none: False), make zero_grad() of the
    optimizer and of the modules zero them in place whatever set_to_none a loop passes (torch's
    default is True), so that a loop's plain zero_grad() keeps them there (the cost of dropping them
    is in grads_to_none). Returns whether it did."""
    if grads_to_none(modules[0]):
        return False
    for obj in (optimizer, *modules):
        obj.zero_grad = _zeroing(obj.zero_grad)
    return True


def _zeroing(zero_grad):
    def in_place(set_to_none: bool = True) -> None:  # torch's signature; dropping would break the views
        zero_grad(set_to_none=False)
    return in_place


def hold_grads(accumulating, *objects) -> None:
    """Make zero_grad() of each object (the optimizer, the modules a loop holds) do nothing while
    `accumulating()` says an update's micro-batches are under way (train.grad_accum_steps), so that
    their gradients add up in .grad whether a loop zeroes them before each backward (the built-in
    loop, compute.Backprop) or after each job.step; the first micro-batch of an update zeroes them."""
    for obj in dict.fromkeys(objects):
        obj.zero_grad = _held(obj.zero_grad, accumulating)


def _held(zero_grad, accumulating):
    def unless_accumulating(set_to_none: bool = True) -> None:
        if not accumulating():
            zero_grad(set_to_none=set_to_none)
    return unless_accumulating


class Accumulation:
    """train.grad_accum_steps = k micro-batches to an update (job.py): which one is under way (`micro`,
    0 at an update's first) and, at the k-th, the update's loss and images with .grad divided by k: the
    mean over its micro-batches, which the strategy averages and applies as it would one batch's
    gradient, so that a loop's own loss needs no 1/k of its own. No host sync: the division is queued
    on the device."""

    def __init__(self, k: int) -> None:
        self.k, self.micro, self.loss, self.images = k, 0, None, 0

    @property
    def last(self) -> bool:
        """Whether the micro-batch under way is its update's last."""
        return self.micro == self.k - 1

    def add(self, loss: torch.Tensor, images: int, params) -> tuple[torch.Tensor, int] | None:
        """One micro-batch stepped: None while its update has more to come; at the k-th, (the mean of
        their losses, their images)."""
        if self.k == 1:
            return loss, images
        self.loss = loss.float() if not self.micro else self.loss + loss.float()
        self.images = images + (self.images if self.micro else 0)
        self.micro += 1
        if self.micro < self.k:
            return None
        self.micro = 0
        torch._foreach_div_([p.grad for p in params if p.grad is not None], float(self.k))
        return self.loss / self.k, self.images


def around(module: torch.nn.Module, optimizer: torch.optim.Optimizer, precision: str, compiled: bool,
           device: torch.device) -> tuple[torch.nn.Module, list[str]]:
    """The module a loop calls (job.wrap's, the built-in loop's and a user's alike): `module` compiled
    when train.compile, its calls autocast at train.precision where that applies (autocast_dtype), and
    the optimizer's zero_grad keeping DDP's bucket views. Also returns the keys that take effect only
    through calls of that module."""
    outer = torch.compile(module) if compiled else module
    keep_bucket_views(optimizer, *dict.fromkeys((module, outer)))
    dtype = autocast_dtype(precision, device)
    if dtype is not None:
        autocast_calls(outer, dtype, device.type)
    return outer, [k for k, on in (("train.precision", dtype is not None), ("train.compile", compiled)) if on]


def grads_to_none(module: torch.nn.Module) -> bool:
    """Whether zero_grad may drop the gradients (set_to_none) before each backward: not under a
    DistributedDataParallel whose gradients are views of its all-reduce buckets
    (gradient_as_bucket_view). Dropped, they cost a fresh allocation per parameter in every backward
    and a copy of each into its bucket, where DDP points .grad back at its view; zeroed in place,
    backward accumulates into the bucket itself. Elsewhere dropping them saves that zeroing."""
    inner = getattr(module, "_orig_mod", module)  # torch.compile's wrapper holds the module it compiles
    return not (isinstance(inner, DistributedDataParallel) and inner.gradient_as_bucket_view)


class Backprop:
    """Forward and backward of each batch the loader gives, through the module job.wrap returned (which
    autocasts and is compiled as the recipe says: compute.around)."""

    def __init__(self, cfg, model: torch.nn.Module, optimizer: torch.optim.Optimizer, loss=None) -> None:
        """loss(output, y): the batch's loss (the job's, job.loss; by default the recipe's, optim.loss_fn)."""
        self.model, self.optimizer = model, optimizer
        if loss is None:
            wd_params, weight_decay = decayed(model), loss_decay(cfg.optim)
            loss = lambda out, y: loss_fn(out.float(), y, wd_params, weight_decay)  # noqa: E731
        self.loss = loss
        self.to_none = grads_to_none(model)

    def __call__(self, batch) -> tuple[torch.Tensor, int]:
        """The batch's loss (on the device, no host sync) and its images; .grad holds the gradient."""
        x, y = batch
        loss = self.loss(self.model(x), y)
        self.optimizer.zero_grad(set_to_none=self.to_none)
        loss.backward()
        return loss.detach(), len(y)


class Emulated:
    """An emulated GPU: no data is read (a GPU node's loaders run on cores of their own), a step
    counts data.batch_size images, its loss is NaN (none is computed), and the gradient is the
    same every step on every replica (drawn once from train.seed), so all strategies and runs agree.
    With train.grad_accum_steps = k each micro-batch adds it, as a backward would, k sleeps an update."""

    def __init__(self, cfg, model: torch.nn.Module, device: torch.device, first=None) -> None:
        """first(): whether the micro-batch under way is its update's first (job.Job.first_micro: their count
        changes after a loss under cluster.after_loss = keep-batch); None: every train.grad_accum_steps-th."""
        # the twin's time dilation (twin/dilation.py): the cluster's step, k times longer
        self.seconds = cfg.train.emulate_compute_s * cfg.cluster.time_scale
        self.images, self.device = cfg.data.batch_size, device
        gen = torch.Generator().manual_seed(cfg.train.seed)
        self.params = list(model.parameters())
        # Memory: one more copy of the parameters.
        self.grads = [(torch.randn(p.shape, generator=gen, dtype=p.dtype) * EMULATED_SCALE).to(device)
                      for p in self.params]
        self.loss = torch.tensor(float("nan"), device=device)
        self.accum, self.calls, self.first = cfg.train.grad_accum_steps, 0, first

    def __call__(self, batch: None) -> tuple[torch.Tensor, int]:
        # Host-device sync: the previous step's all-reduce and optimizer, still queued on a GPU, finish
        # before the sleep stands for this step's forward and backward; else they would run during it
        # and the emulated GPU would hide them, which a real one, busy computing, cannot. Cost: the
        # host waits for them once a step, as a real step's first kernels would.
        metrics.sync(self.device)
        time.sleep(self.seconds)  # the GPU's forward and backward; the host is free meanwhile
        # an update's first micro-batch: no gradient to add to
        first = self.first() if self.first else self.calls % self.accum == 0
        self.calls += 1
        for p, g in zip(self.params, self.grads):
            if p.grad is None:
                p.grad = torch.empty_like(p)
            if first:
                p.grad.copy_(g)  # writes every gradient byte, as a backward pass would
            else:
                p.grad.add_(g)
        return self.loss, self.images
