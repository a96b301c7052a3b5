"""Training augmentations (data.augment): what each does, where it runs, how it is seeded.

In the order they are applied:
  resized-crop  a box of random area (8-100% of the image) and aspect ratio (3/4-4/3, log-uniform),
                resized to the input size (ImageNet-style); without it, the centre square
  crop          the input shifted by up to 1/8 of its side each way, reflected at the border
  flip          mirrored left-right with probability 1/2
  rotation      turned by an angle uniform in [-10, 10] degrees, reflected at the border
  lens          radial lens distortion r -> r (1 + k r^2), k uniform in [-0.2, 0.2] (barrel or pincushion)
  vignetting    darkened towards the corners: x (1 - v r^2 / 2), v uniform in [0, 0.5]
  color         colour cast: R, G and B each shifted by a whole number uniform in [-20, 20] (of 255)
(r: distance from the centre, 1 at the middle of an edge.) The last four follow the set the
companion supercomputer talk trained with (colour casting, vignetting, lens distortion,
rotation, flipping, cropping).

The first three run per sample in the loader, on uint8 pixels, where they are index
arithmetic. The last four are float work on every pixel: they run on the device, batched
(one grid_sample for both warps), after the uint8 copy and before normalisation
(Prepare). Every sample draws a fixed vector of uniforms from a generator seeded by
(seed, epoch, sample index), and each augmentation reads its own entries of it: the same
sample gets the same result on any replica, loader process or resumed run, and turning
one augmentation on does not change what the others draw.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


ON_DEVICE = ("rotation", "lens", "vignetting", "color")
AREA, ASPECT, TRIES = (0.08, 1.0), (3 / 4, 4 / 3), 10
MAX_DEGREES, MAX_LENS, MAX_VIGNETTE, MAX_CAST = 10.0, 0.2, 0.5, 20
# Offsets of each augmentation's uniforms in a sample's draw.
_BOX, _CROP, _FLIP, _ROT, _LENS, _VIG, _CAST, _DRAWS = 0, 4 * TRIES, 4 * TRIES + 2, 4 * TRIES + 3, \
    4 * TRIES + 4, 4 * TRIES + 5, 4 * TRIES + 6, 4 * TRIES + 9
PARAMS = 6  # per sample on the device: angle (rad), lens k, vignette v, cast R, G, B (of 1)


def centre(w: int, h: int) -> tuple[int, int, int, int]:
    """The centre square (top, left, height, width): the whole short side."""
    s = min(w, h)
    return (h - s) // 2, (w - s) // 2, s, s


class Augment:
    """One sample's draws, its box in the source image, its loader ops and its device parameters."""

    def __init__(self, names: list[str], seed: int) -> None:
        self.names, self.seed = set(names), seed
        self.on_device = any(n in self.names for n in ON_DEVICE)

    def draws(self, epoch: int, i: int) -> torch.Tensor:
        # within a signed 64-bit seed for any train.seed; unchanged below 2^63 - 1
        g = torch.Generator().manual_seed(((self.seed * 1_000_003 + epoch) * 10_000_019 + i) % (2**63 - 1))
        return torch.rand(_DRAWS, generator=g, dtype=torch.float64)

    def box(self, u: torch.Tensor, w: int, h: int) -> tuple[int, int, int, int]:
        if "resized-crop" not in self.names:
            return centre(w, h)
        lo, hi = math.log(ASPECT[0]), math.log(ASPECT[1])
        for t in range(TRIES):
            a, r, y, x = u[_BOX + 4 * t:_BOX + 4 * t + 4].tolist()
            area = w * h * (AREA[0] + (AREA[1] - AREA[0]) * a)
            ratio = math.exp(lo + (hi - lo) * r)
            bw, bh = round(math.sqrt(area * ratio)), round(math.sqrt(area / ratio))
            if 0 < bw <= w and 0 < bh <= h:
                return int(y * (h - bh + 1)), int(x * (w - bw + 1)), bh, bw
        # no try fitted (an extreme aspect ratio): the whole image, cut to the nearest allowed aspect
        bw, bh = (w, min(h, round(w / ASPECT[0]))) if w / h < ASPECT[0] else (min(w, round(h * ASPECT[1])), h)
        return (h - bh) // 2, (w - bw) // 2, bh, bw

    def moves(self, u: torch.Tensor, size: int) -> tuple[int, int, int]:
        """(dy, dx, flip) of crop and flip for an input of side `size`: what loader_ops does, as numbers,
        for the device's batched version of it (device_input.move)."""
        dy = dx = 0
        if "crop" in self.names:
            pad = max(1, size // 8)
            dy, dx = (int(v * (2 * pad + 1)) - pad for v in u[_CROP:_CROP + 2].tolist())
        return dy, dx, int("flip" in self.names and bool(u[_FLIP] < 0.5))

    def loader_ops(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """crop and flip on HWC uint8 pixels: index arithmetic, no arithmetic on values."""
        dy, dx, flip = self.moves(u, x.shape[0])
        if dy or dx:
            x = _shift(_shift(x, dy, 0), dx, 1)
        if flip:
            x = x.flip(1)
        return x

    def device_params(self, u: torch.Tensor) -> torch.Tensor:
        p = torch.zeros(PARAMS, dtype=torch.float32)
        if "rotation" in self.names:
            p[0] = math.radians(MAX_DEGREES * (2 * u[_ROT] - 1))
        if "lens" in self.names:
            p[1] = MAX_LENS * (2 * u[_LENS] - 1)
        if "vignetting" in self.names:
            p[2] = MAX_VIGNETTE * u[_VIG]
        if "color" in self.names:
            p[3:] = torch.floor(u[_CAST:_CAST + 3] * (2 * MAX_CAST + 1) - MAX_CAST) / 255
        return p


def _shift(x: torch.Tensor, d: int, dim: int) -> torch.Tensor:
    """x moved by d along dim: out[i] = x[i + d], mirrored at the edge (without repeating it), as
    reflect padding by |d| then cropping back. Slices and one cat: far cheaper than an indexed gather."""
    n = x.shape[dim]
    if d > 0:
        return torch.cat([x.narrow(dim, d, n - d), x.narrow(dim, n - 1 - d, d).flip(dim)], dim)
    if d < 0:
        return torch.cat([x.narrow(dim, 1, -d).flip(dim), x.narrow(dim, 0, n + d)], dim)
    return x


def on_device(x: torch.Tensor, p: torch.Tensor, names) -> torch.Tensor:
    """rotation, lens, vignetting and color on a float NCHW batch in [0, 1], with each sample's
    parameters p (N x PARAMS); clamped back to [0, 1]."""
    n, _, h, w = x.shape
    ys = (torch.arange(h, device=x.device, dtype=x.dtype) + 0.5) * (2 / h) - 1  # pixel centres in [-1, 1]
    xs = (torch.arange(w, device=x.device, dtype=x.dtype) + 0.5) * (2 / w) - 1
    ys, xs = ys.view(1, h, 1), xs.view(1, 1, w)
    r2 = xs * xs + ys * ys
    if "rotation" in names or "lens" in names:
        # where each output pixel reads from: rotated by the angle, then pushed out (k > 0) or in
        angle, k = p[:, 0].view(n, 1, 1), p[:, 1].view(n, 1, 1)
        scale, c, s = 1 + k * r2, torch.cos(angle), torch.sin(angle)
        grid = torch.stack(((c * xs - s * ys) * scale, (s * xs + c * ys) * scale), dim=-1)
        x = F.grid_sample(x, grid, mode="bilinear", padding_mode="reflection", align_corners=False)
    if "vignetting" in names:
        x = x * (1 - p[:, 2].view(n, 1, 1, 1) * r2.unsqueeze(0) / 2)
    if "color" in names:
        x = x + p[:, 3:].view(n, 3, 1, 1)
    return x.clamp_(0, 1)
