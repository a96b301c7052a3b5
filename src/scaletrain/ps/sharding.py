"""How parameters are split over parameter-server shards.

A shard is a tuple of Segments, element ranges of flattened parameters in
model order. Two methods:

- "round-robin": whole tensors, tensor i to shard i % P, as the study's
  framework did. Big weights and their small biases alternate between servers,
  so with ResNet-50 some servers get several times the mean load.
- "balanced": all parameters concatenated in model order and cut into P
  contiguous ranges of equal size (sizes differ by at most one element).
  Tensors must be split for this: ResNet-50 with 1,200 classes has 26M values
  and a 2.46M-value classifier, more than a fair share at 16 PS (1.6M), so no
  whole-tensor assignment, greedy or otherwise, gets max/mean below ~1.5 there.
  Contiguous ranges also keep the segment count small (at most P - 1 tensors
  are cut). A cut tensor's norm is no shard's to take: optimizers that scale
  each layer by its norms (lars, lamb) need whole tensors, round-robin.

Pure tensor code: no communication here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

METHODS = ("balanced", "round-robin")


@dataclass(frozen=True)
class Segment:
    param: int  # index of the parameter in model order
    lo: int     # first element of the flattened parameter
    hi: int     # one past the last element


@dataclass(frozen=True)
class ShardLayout:
    shards: tuple[tuple[Segment, ...], ...]

    @property
    def num_shards(self) -> int:
        return len(self.shards)

    def numel(self, k: int) -> int:
        return sum(s.hi - s.lo for s in self.shards[k])

    def bytes(self, k: int, itemsize: int = 4) -> int:
        return self.numel(k) * itemsize

    def balance(self) -> float:
        """Largest shard over mean shard (1.0 = perfect); the busiest PS sets the pace."""
        sizes = [self.numel(k) for k in range(self.num_shards)]
        return max(sizes) * len(sizes) / sum(sizes)


def make_layout(numels: list[int], num_shards: int, method: str) -> ShardLayout:
    """Split parameters with these element counts (model order) over num_shards."""
    total = sum(numels)
    if method not in METHODS:
        raise ValueError(f"sharding method {method!r}: choose one of {', '.join(METHODS)}")
    if num_shards < 1 or num_shards > total:
        raise ValueError(f"num_shards = {num_shards}: must be in [1, {total}] (total parameter elements)")
    if method == "round-robin":
        return ShardLayout(tuple(tuple(Segment(i, 0, n) for i, n in enumerate(numels) if i % num_shards == k)
                                 for k in range(num_shards)))
    starts = [0]
    for n in numels:
        starts.append(starts[-1] + n)
    shards = []
    for k in range(num_shards):
        a, b = k * total // num_shards, (k + 1) * total // num_shards
        shards.append(tuple(Segment(i, max(a, s) - s, min(b, s + n) - s)
                            for i, (s, n) in enumerate(zip(starts, numels))
                            if max(a, s) < min(b, s + n)))
    return ShardLayout(tuple(shards))


@dataclass(frozen=True)
class Piece:
    """A segment as a shard's optimizer sees it: where it lies in the shard's flat tensor, and what it
    is of its parameter. adamw, lars and lamb step each piece as a parameter of its own (optim.py)."""
    offset: int     # first element in the shard's flat tensor
    size: int       # elements
    excluded: bool  # of a bias or normalisation parameter (ndim <= 1): no weight decay, no trust ratio
    whole: bool     # the whole parameter, so that the piece's norms are its layer's


def pieces(shard: tuple[Segment, ...], shapes: list[tuple[int, ...]]) -> tuple[Piece, ...]:
    """The shard's segments as Pieces; `shapes`: every parameter's shape, in model order."""
    out, off = [], 0
    for s in shard:
        numel = math.prod(shapes[s.param])
        out.append(Piece(off, s.hi - s.lo, len(shapes[s.param]) <= 1, s.lo == 0 and s.hi == numel))
        off += s.hi - s.lo
    return tuple(out)


def gather(tensors: list[torch.Tensor], shard: tuple[Segment, ...], out: torch.Tensor | None = None) -> torch.Tensor:
    """The shard's elements as one 1-D tensor (of parameters or of gradients): a new one, or
    written into `out` (a buffer kept across steps, see Strategy.buffer)."""
    with torch.no_grad():
        if not shard:
            ref = tensors[0]
            return torch.empty(0, dtype=ref.dtype, device=ref.device)
        return torch.cat([tensors[s.param].detach().reshape(-1)[s.lo:s.hi] for s in shard], out=out)


def scatter_(tensors: list[torch.Tensor], shard: tuple[Segment, ...], flat: torch.Tensor) -> None:
    """Copy a 1-D tensor laid out as gather() makes it back into the segments, in place."""
    want = sum(s.hi - s.lo for s in shard)
    if flat.dim() != 1 or flat.numel() != want:
        raise ValueError(f"scatter_: flat has shape {tuple(flat.shape)}, shard needs ({want},)")
    with torch.no_grad():
        off = 0
        for s in shard:
            t, n = tensors[s.param], s.hi - s.lo
            src = flat[off:off + n]
            if t.is_contiguous():
                t.view(-1)[s.lo:s.hi].copy_(src)
            else:
                # e.g. channels_last weights: no flat view exists, so round-trip
                # through a copy in logical order (costs one tensor-sized copy).
                tmp = t.reshape(-1).clone()
                tmp[s.lo:s.hi] = src
                t.copy_(tmp.view(t.shape))
            off += n
