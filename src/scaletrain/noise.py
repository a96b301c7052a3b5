"""The gradient noise scale, measured while training (McCandlish et al. 2018, "An Empirical Model
of Large-Batch Training", appendix A).

The simple noise scale B_simple = tr(Sigma) / |G|^2: Sigma the covariance of one example's gradient,
G the true gradient. The batch that trains about as well per image as the smallest and about as
fast per step as the largest is of that order: steps to a target go as S = S_min (1 + B_noise / B).

A gradient over a batch of B examples has E|g_B|^2 = |G|^2 + tr(Sigma) / B. Data-parallel
training holds two batch sizes at every step with no extra work: each replica's own gradient (b
images) and their average over the group of n replicas (n b), which DistributedDataParallel makes
in backward (strategies/allreduce.py's hook measures both per bucket). From the two squared norms:

    |G|^2     ~ (n b |g_nb|^2 - b |g_b|^2) / (n b - b)
    tr(Sigma) ~ (|g_b|^2 - |g_nb|^2) / (1/b - 1/(n b))

Each is unbiased but noisy, so each is smoothed (a mean over a log window, then an exponential
moving average over windows) before their ratio is taken, as the paper does: the value at a log
point. A run's summary gives the ratio of their means over the whole run (`overall`), steadier
late in training, when |G|^2 is small beside its noise. A replica's own
squared norm stands for the replicas' mean: it is unbiased, and the average over steps takes out
the rest.

A replica with no group (one process; one per node under a PS) has one batch size only. With
train.noise_every = N it makes a second every N steps (job.py, `half_batch`): the gradient of the
first half of its batch, by one more backward through the batch's graph, beside the whole batch's
gradient that the loop's backward leaves in .grad. The cost is that backward, once per N steps.
No estimate from gradients made up (train.emulate_compute_s) that no backward computed.

With gradient accumulation (train.grad_accum_steps = k) a replica's gradient is the mean over its k
micro-batches, b = k x data.batch_size images: the batch sizes above are the update's. DDP's buckets
then hold the sum of the k micro-batches' gradients, k times that mean (its squared norms k^2 times
theirs: `sum_of`); the half batch of one replica is half of one micro-batch, against the update's mean.
"""

from __future__ import annotations

import math

import torch

SMOOTHING = 0.2  # weight of the newest log window in the moving averages


def two_batch(small_sq: float, big_sq: float, b_small: int, b_big: int) -> tuple[float, float]:
    """(|G|^2, tr(Sigma)) estimated from the squared norms of gradients over b_small and b_big examples."""
    g2 = (b_big * big_sq - b_small * small_sq) / (b_big - b_small)
    s = (small_sq - big_sq) / (1 / b_small - 1 / b_big)
    return g2, s


class NoiseScale:
    """Sums of squared gradient norms at two batch sizes, accumulated on the device a bucket at a time
    (no host sync), and read at log points into smoothed estimates."""

    def __init__(self, b_small: int, b_big: int, device: torch.device, sum_of: int = 1) -> None:
        """sum_of: the gradients whose norms are added are sums of this many equally weighted means
        (accumulated micro-batches), so their squared norms are divided by its square."""
        if b_big <= b_small:
            raise ValueError(f"two batch sizes are needed, got {b_small} and {b_big}")
        self.b_small, self.b_big, self.sum_of = b_small, b_big, sum_of
        self.sums = torch.zeros(2, dtype=torch.float64, device=device)  # [own |g_b|^2, averaged |g_nb|^2]
        # Each bucket's squared norms of the current backward, in a slot of its own. DDP may run the
        # buckets' callbacks at once, on a pool of CUDA streams: a `+=` of theirs on one shared tensor
        # is a read-modify-write that two streams can interleave, losing an update. A slot has one
        # writer; step() sums them on the caller's stream once backward has returned.
        self.slots: dict[int, torch.Tensor] = {}
        self.fresh: set[int] = set()  # the buckets whose slot this backward wrote
        self.steps = 0
        self.g2 = self.s = None  # the moving averages, None before the first window
        self.totals = [0.0, 0.0, 0]  # |G|^2 and tr(Sigma) estimates summed over every step so far, and the steps

    def add(self, own: torch.Tensor, averaged: torch.Tensor, bucket: int = 0) -> None:
        """One bucket's squared norms (0-d tensors on the device): this replica's, and the group's mean's.
        bucket: its index (DDP's bucket.index()), a slot no other bucket writes; a second add to one
        bucket before step() replaces the first."""
        slot = self.slots.get(bucket)
        if slot is None:
            slot = self.slots[bucket] = torch.zeros(2, dtype=torch.float64, device=self.sums.device)
        slot.copy_(torch.stack((own.detach(), averaged.detach())))
        self.fresh.add(bucket)

    def step(self) -> None:
        """The end of a step, after its backward: the buckets' norms join the window's sums."""
        if self.fresh:
            self.sums += torch.stack([self.slots[b] for b in sorted(self.fresh)]).sum(0)
            self.fresh.clear()
        self.steps += 1

    def window(self) -> float | None:
        """Close a log window: fold its mean squared norms into the moving averages and return the
        noise scale so far (None while |G|^2 is not yet positive). A host-device sync: log points only."""
        if not self.steps:
            return self.value
        small, big = (self.sums / (self.steps * self.sum_of ** 2)).tolist()
        self.sums.zero_()
        g2, s = two_batch(small, big, self.b_small, self.b_big)
        self.totals = [self.totals[0] + g2 * self.steps, self.totals[1] + s * self.steps, self.totals[2] + self.steps]
        self.steps = 0
        if self.g2 is None:
            self.g2, self.s = g2, s
        else:
            self.g2 += SMOOTHING * (g2 - self.g2)
            self.s += SMOOTHING * (s - self.s)
        return self.value

    @property
    def overall(self) -> float | None:
        """B_simple of the whole run so far: the mean tr(Sigma) over the mean |G|^2 of every step (None
        as for value). Steadier than the moving value late in training, when |G|^2 is small beside
        its noise: the figure a run's summary gives."""
        g2, s, steps = self.totals
        return _ratio(s / steps, g2 / steps) if steps else None

    @property
    def value(self) -> float | None:
        """B_simple, in images; None before a window, or while the smoothed |G|^2 is not positive or
        tr(Sigma) negative (the gradient lost in its noise: no estimate, rather than a negative or
        infinite one)."""
        return None if self.g2 is None else _ratio(self.s, self.g2)


def _ratio(s: float, g2: float) -> float | None:
    """tr(Sigma) / |G|^2, or None where |G|^2 is not positive or tr(Sigma) is negative."""
    if not g2 > 0 or not s >= 0 or not math.isfinite(s):
        return None
    return s / g2


def squared_norm(tensors) -> torch.Tensor:
    """The sum of squares of every element of the tensors (None skipped), a 0-d tensor on their device."""
    return torch.stack([torch.dot(t.flatten(), t.flatten()) for t in tensors if t is not None]).sum()


def half_batch(loss_fn, output: torch.Tensor, y: torch.Tensor, params) -> torch.Tensor:
    """The squared norm of the gradient of loss_fn over the first half of the batch (output, y), by a
    backward that keeps the graph for the loop's own (retain_graph): one backward's compute. y's rows
    are the half's own targets, class indices or soft ones (mixing.py): a mixed batch's first half
    mixes only its own images, so it is a mixed batch of half the size."""
    half = len(y) // 2
    grads = torch.autograd.grad(loss_fn(output[:half], y[:half]), params, retain_graph=True, allow_unused=True)
    return squared_norm(grads)
