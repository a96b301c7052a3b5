"""Label smoothing, mixup and CutMix: the soft targets a replica trains toward, made on its device.

With any of train.label_smoothing, data.mixup_alpha or data.cutmix_alpha on, job.batches() gives
(x, y) with y the batch's targets as class probabilities (N x model.num_classes, float32) rather
than class indices. torch's cross_entropy takes either, so job.loss, the pipeline's last stage and
a loop's own F.cross_entropy(model(x), y) all train toward the same targets with no other change.

Each batch is mixed after it reaches the device (job.batches, after the tracker's inputs), in the
training process: the loaders stay as they are, and the cost is one gather of the batch and a few
element-wise passes on the device, small beside a forward. The draws (whether mixup or CutMix, the
weight lambda, the box) are a few host scalars from a generator seeded by (train.seed, job step,
replica): every replica mixes differently, a resumed run mixes as an uninterrupted one did, and
there is no state to checkpoint.

As timm's Mixup (timm/data/mixup.py) does, one lambda per batch is drawn from Beta(alpha, alpha);
mixup blends each image with its partner, x = lam x + (1 - lam) x', CutMix pastes the partner's
box of (1 - lam) of the area, lambda then corrected to the box's exact share; with both on, each
batch takes one of them with probability 0.5. Labels are smoothed, then mixed the same way.

Partners are the batch reversed within each half (timm reverses the whole batch): the first half of
a batch is then a mixed batch of its own images only, so the half-batch gradient of the noise scale
(noise.half_batch, train.noise_every) is that of half as many independent samples as the whole
batch's, as its estimate assumes. Evaluation is untouched: test batches keep hard labels.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F

CUTMIX_SHARE = 0.5  # with both alphas on, the probability that a batch is CutMix rather than mixup


@dataclass(frozen=True)
class Draw:
    """One batch's mixing: kind "mixup", "cutmix" or "none"; lam, the weight of each image's own
    source in its pixels and target (for CutMix, the exact share of its area outside the box); box,
    the rows [top, bottom) and columns [left, right) pasted from the partner (CutMix only)."""
    kind: str
    lam: float = 1.0
    box: tuple[int, int, int, int] | None = None


def draw(mixup_alpha: float, cutmix_alpha: float, seed: int, step: int, replica: int,
         height: int, width: int) -> Draw:
    """The mixing of a batch, a pure function of (seed, step, replica) and the image's size: a
    string seed is hashed by random.Random with SHA-512, the same on every host and Python."""
    if not mixup_alpha and not cutmix_alpha:
        return Draw("none")
    rng = random.Random(f"scaletrain-mixing:{seed}:{step}:{replica}")
    cutmix = cutmix_alpha > 0 and (mixup_alpha <= 0 or rng.random() < CUTMIX_SHARE)
    lam = rng.betavariate(*(2 * [cutmix_alpha if cutmix else mixup_alpha]))
    if not cutmix:
        return Draw("mixup", lam)
    box = cut_box(rng, lam, height, width)
    top, bottom, left, right = box
    return Draw("cutmix", 1.0 - (bottom - top) * (right - left) / (height * width), box)


def cut_box(rng: random.Random, lam: float, height: int, width: int) -> tuple[int, int, int, int]:
    """CutMix's box: sides sqrt(1 - lam) of the image's, centred at a uniform pixel, clipped to the
    image (so its area may fall below 1 - lam: the caller corrects lambda by it)."""
    ratio = math.sqrt(1.0 - lam)
    h, w = int(height * ratio), int(width * ratio)
    cy, cx = rng.randrange(height), rng.randrange(width)
    return (min(max(cy - h // 2, 0), height), min(max(cy + h // 2, 0), height),
            min(max(cx - w // 2, 0), width), min(max(cx + w // 2, 0), width))


def partners(n: int, device: torch.device | None = None) -> torch.Tensor:
    """Each image's partner: the batch reversed within each half (halves of n // 2 and the rest)."""
    half = n // 2  # made where the batch is: a copy from host memory would wait for the GPU
    return torch.cat((torch.arange(half - 1, -1, -1, device=device), torch.arange(n - 1, half - 1, -1, device=device)))


def soft_targets(y: torch.Tensor, classes: int, smoothing: float = 0.0) -> torch.Tensor:
    """Class indices as probabilities, smoothed as torch's cross_entropy(label_smoothing=) does:
    1 - smoothing on the class, plus smoothing / classes on every class."""
    return F.one_hot(y, classes).float().mul_(1.0 - smoothing).add_(smoothing / classes)


def mix(x: torch.Tensor, y: torch.Tensor, classes: int, d: Draw, smoothing: float = 0.0):
    """(x, y) mixed as `d` says: x N x C x H x W (changed in place and returned), y class indices;
    returns the images and their soft targets. Runs on x's device with no host sync."""
    target = soft_targets(y, classes, smoothing)
    if d.kind == "none":
        return x, target
    other = partners(len(y), y.device)
    if d.kind == "mixup":
        pair = x[other]  # a copy, before x changes: one more batch of memory
        x.mul_(d.lam).add_(pair, alpha=1.0 - d.lam)
    else:
        top, bottom, left, right = d.box
        x[:, :, top:bottom, left:right] = x[other, :, top:bottom, left:right]
    pair = target[other]
    return x, target.mul_(d.lam).add_(pair, alpha=1.0 - d.lam)


class Mixer:
    """A replica's mixing of its training batches (the recipe's keys); `on` says whether it changes any."""

    def __init__(self, cfg, replica: int) -> None:
        d, t = cfg.data, cfg.train
        self.mixup, self.cutmix, self.smoothing = d.mixup_alpha, d.cutmix_alpha, t.label_smoothing
        self.seed, self.replica, self.classes = t.seed, replica, cfg.model.num_classes
        self.on = bool(self.mixup or self.cutmix or self.smoothing)

    def __call__(self, batch: tuple[torch.Tensor, torch.Tensor], step: int):
        """The batch (x, y) of job step `step`, mixed: (x, soft targets)."""
        x, y = batch
        d = draw(self.mixup, self.cutmix, self.seed, step, self.replica, x.shape[-2], x.shape[-1])
        return mix(x, y, self.classes, d, self.smoothing)
