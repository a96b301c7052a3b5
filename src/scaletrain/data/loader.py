"""Per-replica sharding, augmentation and background loading.

Sharding: at global step t of epoch e, the W replicas of batch b together
take positions [t*W*b, (t+1)*W*b) of the epoch's permutation, replica r the
r-th slice of b. So the union of the replicas' batches is exactly the batch a
single process with batch W*b sees at step t, and the position in the data is
a function of the step alone (exact resume needs nothing else).

Augmentation draws from a generator seeded by (seed, epoch, sample index):
the same sample gets the same crop whichever replica, worker or resumed run
loads it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .sources import BadImage


class ShardedBatches:
    """Batch sampler: one list of (index, epoch) per step, from `start` to `stop`."""

    def __init__(self, n: int, batch: int, world: int = 1, rank: int = 0, seed: int = 0,
                 start: int = 0, stop: int | None = None, shuffle: bool = True) -> None:
        self.n, self.batch, self.world, self.rank, self.seed = n, batch, world, rank, seed
        self.per_epoch = n // (batch * world)
        if self.per_epoch == 0:
            raise ValueError(f"{n} training images are fewer than one global batch "
                             f"({world} replicas x {batch}); lower data.batch_size")
        self.start, self.stop, self.shuffle = start, stop, shuffle

    def indices(self, step: int) -> list[int]:
        epoch, k = divmod(step, self.per_epoch)
        perm = self._perm(epoch)
        lo = (k * self.world + self.rank) * self.batch
        return perm[lo:lo + self.batch].tolist()

    def _perm(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.n)
        if getattr(self, "_cached", (None,))[0] != epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._cached = (epoch, torch.randperm(self.n, generator=g))
        return self._cached[1]

    def __iter__(self):
        step = self.start
        while self.stop is None or step < self.stop:
            epoch = step // self.per_epoch
            yield [(i, epoch) for i in self.indices(step)]
            step += 1

    def __len__(self) -> int:
        return (self.stop - self.start) if self.stop is not None else 2**62


class Augmented(torch.utils.data.Dataset):
    """Random crop (pad by 1/8 then crop back) and horizontal flip, per sample."""

    def __init__(self, base, mode: str, seed: int) -> None:
        self.base, self.crop, self.flip, self.seed = base, "crop" in mode, "flip" in mode, seed

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, key):
        i, epoch = key if isinstance(key, tuple) else (key, 0)
        item = self.base[i]
        if isinstance(item, BadImage) or not (self.crop or self.flip):
            return item
        x, y = item
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) * 10_000_019 + i)
        r = torch.randint(0, 2**31 - 1, (3,), generator=g).tolist()
        if self.crop:
            size = x.shape[-1]
            pad = max(1, size // 8)
            x = F.pad(x.unsqueeze(0), (pad, pad, pad, pad), mode="reflect").squeeze(0)
            top, left = r[0] % (2 * pad + 1), r[1] % (2 * pad + 1)
            x = x[:, top:top + size, left:left + size]
        if self.flip and r[2] % 2:
            x = x.flip(-1)
        return x.contiguous(), y


class Plain(torch.utils.data.Dataset):
    """Accepts the sampler's (index, epoch) keys without augmenting."""

    def __init__(self, base) -> None:
        self.base = base

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, key):
        return self.base[key[0] if isinstance(key, tuple) else key]


@dataclass
class Batch:
    x: torch.Tensor
    y: torch.Tensor
    bad: list[BadImage]


def collate(items) -> Batch:
    good = [it for it in items if not isinstance(it, BadImage)]
    bad = [it for it in items if isinstance(it, BadImage)]
    if not good:
        return Batch(torch.empty(0), torch.empty(0, dtype=torch.long), bad)
    return Batch(torch.stack([g[0] for g in good]), torch.tensor([g[1] for g in good]), bad)


def _one_thread(_: int) -> None:
    # Loader processes decode and augment; one thread each avoids
    # oversubscribing the cores the training process computes on.
    torch.set_num_threads(1)


def make_loader(dataset, sampler, workers: int, prefetch: int, pin: bool) -> torch.utils.data.DataLoader:
    kw = dict(num_workers=workers, collate_fn=collate, pin_memory=pin)
    if workers:
        kw.update(prefetch_factor=prefetch, worker_init_fn=_one_thread)
    return torch.utils.data.DataLoader(dataset, batch_sampler=sampler, **kw)


def train_loader(train_set, cfg, start: int, stop: int, world: int = 1, rank: int = 0, pin: bool = False):
    d = cfg.data
    sampler = ShardedBatches(len(train_set), d.batch_size, world, rank, cfg.train.seed, start, stop)
    ds = Augmented(train_set, d.augment, cfg.train.seed) if d.augment != "none" else Plain(train_set)
    return make_loader(ds, sampler, d.workers, d.prefetch, pin), sampler


def test_loader(test_set, cfg, pin: bool = False, rank: int = 0, world: int = 1):
    """This worker's slice of the test set (every world-th image from `rank`): the workers
    evaluate their slices at once and sum what they count."""
    mine, b = list(range(rank, len(test_set), world)), max(cfg.data.batch_size, 64)
    batches = [[(i, 0) for i in mine[lo:lo + b]] for lo in range(0, len(mine), b)]
    return make_loader(Plain(test_set), batches, cfg.data.workers, cfg.data.prefetch, pin)
