"""Per-replica sharding, per-sample decoding and augmentation, background loading, and
the device's part of the input: batched augmentations and normalisation.

Sharding: at global step t of epoch e, the W replicas of batch b together
take positions [t*W*b, (t+1)*W*b) of the epoch's permutation, replica r the
r-th slice of b. So the union of the replicas' batches is exactly the batch a
single process with batch W*b sees at step t, and the position in the data is
a function of the step alone (exact resume needs nothing else). A data set
may order an epoch itself (`epoch_order`): shards give each replica its own
stretch of the epoch, read front to back (shards.py); the step still fixes
the position.

Loader processes hand over uint8 pixels (HWC), a quarter of the bytes of
float32, or with data.decode = "device" the JPEGs' bytes (device_input.py);
Prepare turns them into the network's input on the device.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from functools import partial

import torch

from ..config_checks import STOP_SIGNALS
from ..imports import one_line
from ..proc.parent import die_with_parent
from . import decode
from .augment import Augment, centre, on_device
from .device_input import DeviceBatches, Encoded, Jpeg, collate_encoded, decoder_for, to_device, torchvision_io
from .sources import BadImage

STOPS = [getattr(signal, n) for n in STOP_SIGNALS]  # every signal a job may stop on (cluster.stop_signals)


class ShardedBatches:
    """Batch sampler: one list of (index, epoch) per step, from `start` to `stop`.

    `order(seed, epoch, world, rank)`, when given, is this replica's sequence of the epoch
    (at least per_epoch * batch indices); by default, the r-th slices of a global permutation."""

    def __init__(self, n: int, batch: int, world: int = 1, rank: int = 0, seed: int = 0,
                 start: int = 0, stop: int | None = None, shuffle: bool = True, order=None) -> None:
        self.n, self.batch, self.world, self.rank, self.seed = n, batch, world, rank, seed
        self.per_epoch = n // (batch * world)
        if self.per_epoch == 0:
            raise ValueError(f"{n} training images are fewer than one global batch "
                             f"({world} replicas x {batch}); lower data.batch_size")
        self.start, self.stop, self.shuffle, self.order = start, stop, shuffle, order or self._slices
        self._cached = (None, None)

    def indices(self, step: int) -> list[int]:
        epoch, k = divmod(step, self.per_epoch)
        if self._cached[0] != epoch:
            self._cached = (epoch, self.order(self.seed, epoch, self.world, self.rank))
        return self._cached[1][k * self.batch:(k + 1) * self.batch].tolist()

    def _slices(self, seed: int, epoch: int, world: int, rank: int) -> torch.Tensor:
        used = self.per_epoch * world * self.batch
        if not self.shuffle:
            perm = torch.arange(used)
        else:
            perm = torch.randperm(self.n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        return perm[:used].view(self.per_epoch, world, self.batch)[:, rank].reshape(-1)

    def __iter__(self):
        step = self.start
        while self.stop is None or step < self.stop:
            epoch = step // self.per_epoch
            yield [(i, epoch) for i in self.indices(step)]
            step += 1

    def __len__(self) -> int:
        return (self.stop - self.start) if self.stop is not None else 2**62


class Samples(torch.utils.data.Dataset):
    """(index, epoch) -> (HWC uint8 pixels of side `size`, label, device parameters), or a
    BadImage naming the sample when it cannot be read or decoded.

    encoded (data.decode = "device"): a JPEG comes as a device_input.Jpeg (its bytes, and the box its
    header and draws give), other images as pixels fitted but not moved, and a fourth item, the
    sample's crop shift and flip (Augment.moves), for the device to apply to the batch."""

    def __init__(self, base, size: int, augment: Augment | None = None, encoded: bool = False) -> None:
        self.base, self.size, self.augment, self.encoded = base, size, augment, encoded

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, key):
        i, epoch = key if isinstance(key, tuple) else (key, 0)
        a = self.augment
        u = a.draws(epoch, i) if a else None
        box = (lambda w, h: a.box(u, w, h)) if a else centre
        try:
            raw, y = self.base[i]  # encoded bytes, or pixels already decoded (HWC uint8)
            if self.encoded and isinstance(raw, bytes) and raw[:2] == decode.JPEG_MAGIC:
                w, h = decode.image_size(raw)  # the header alone: the pixels are the device's to decode
                x = Jpeg(raw, box(w, h), (w, h), self.size, self.base.name(i))
            else:
                x = decode.load(raw, box, self.size) if isinstance(raw, bytes) else \
                    decode.fit(raw, box(raw.shape[1], raw.shape[0]), self.size)
        except Exception as e:  # noqa: BLE001 - any read or decoder failure is a bad image
            return BadImage(self.base.name(i), one_line(e))
        params = a.device_params(u) if a is not None and a.on_device else None
        if self.encoded:
            return x, y, params, a.moves(u, self.size) if a is not None else (0, 0, 0)
        return (x, y, None) if a is None else (a.loader_ops(x, u), y, params)


@dataclass
class Batch:
    x: torch.Tensor  # N x H x W x 3 uint8 (empty while `encoded` holds the images)
    y: torch.Tensor
    bad: list[BadImage]
    params: torch.Tensor | None = None  # N x augment.PARAMS, for the device's augmentations
    encoded: Encoded | None = None  # data.decode = "device": the images, for device_input.to_device

    def pin_memory(self) -> "Batch":
        """Page-locked copies (the DataLoader calls this when pin_memory is on), so the copy to
        a GPU can overlap with compute (non_blocking)."""
        pin = lambda t: None if t is None else t.pin_memory()  # noqa: E731
        return Batch(pin(self.x), pin(self.y), self.bad, pin(self.params),
                     self.encoded and self.encoded.pin_memory())


def collate(items) -> Batch:
    good = [it for it in items if not isinstance(it, BadImage)]
    bad = [it for it in items if isinstance(it, BadImage)]
    if not good:
        return Batch(torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=torch.long), bad)
    params = torch.stack([g[2] for g in good]) if good[0][2] is not None else None
    y = torch.tensor([g[1] for g in good])
    if len(good[0]) == 4:  # Samples(encoded=True)
        return Batch(torch.empty(0, dtype=torch.uint8), y, bad, params, collate_encoded(good))
    return Batch(torch.stack([g[0] for g in good]), y, bad, params)


class Prepare:
    """The device's part of the input: uint8 pixels -> [0, 1] -> the augmentations that are
    float work (augment.ON_DEVICE), batched -> normalised by the data set's channel statistics."""

    def __init__(self, names, stats: tuple, device: torch.device, channels_last: bool = False) -> None:
        self.names, self.device = set(names), device
        self.mean, self.std = (torch.tensor(v, dtype=torch.float32, device=device).view(1, 3, 1, 1)
                               for v in stats)
        self.format = torch.channels_last if channels_last else torch.contiguous_format

    def __call__(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        # one copy of uint8 to the device; its NCHW view of HWC memory is channels-last
        x = batch.x.to(self.device, non_blocking=True).permute(0, 3, 1, 2).float().div_(255)
        if batch.params is not None:
            x = on_device(x, batch.params.to(self.device, non_blocking=True), self.names)
        x = x.sub_(self.mean).div_(self.std).contiguous(memory_format=self.format)
        return x, batch.y.to(self.device, non_blocking=True)


def _loader_setup(parent: int, _: int) -> None:
    # Loader processes decode and augment; one thread each avoids
    # oversubscribing the cores the training process computes on.
    torch.set_num_threads(1)
    # A stop signal is the training process's to act on (a checkpoint at the next sync point). A
    # scheduler sends it to every process of the job (scancel, preemption, a time limit), these
    # included; torch's own handler ends a loader process on a SIGTERM that its parent did not send,
    # and the training process then fails at its next batch. Held since the fork (_Loader).
    for s in STOPS:
        signal.signal(s, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOPS)
    # Gone with the training process, at once: torch's own check of the parent waits up to 5 s.
    die_with_parent(parent)


class _Loader(torch.utils.data.DataLoader):
    """A DataLoader whose loader processes start with the stop signals held (blocked): one that came
    between a fork and _loader_setup would end the process before it ignores them."""

    def __iter__(self):
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOPS)  # loader processes are forked here
        try:
            return super().__iter__()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def make_loader(dataset, sampler, workers: int, prefetch: int, pin: bool) -> torch.utils.data.DataLoader:
    kw = dict(num_workers=workers, collate_fn=collate, pin_memory=pin)
    if not workers:
        return torch.utils.data.DataLoader(dataset, batch_sampler=sampler, **kw)
    kw.update(prefetch_factor=prefetch, worker_init_fn=partial(_loader_setup, os.getpid()))
    return _Loader(dataset, batch_sampler=sampler, **kw)


def device_loader(loader, cfg, pin: bool, device: torch.device | None = None):
    """The loader as the training process iterates it: on a CUDA device (pin; the process's current one
    unless `device` says) its batches come to the device one ahead on a side stream, and with
    data.decode = "device" are decoded there (device_input.DeviceBatches); a host-decoded loader on the
    CPU is left as it is."""
    device = device or (torch.device("cuda", torch.cuda.current_device()) if pin else torch.device("cpu"))
    encoded = cfg.data.decode == "device"
    if not encoded and device.type == "cpu":
        return loader
    decoder = decoder_for(device) if encoded else None
    if encoded and device.type == "cuda":
        torchvision_io()  # a missing torchvision is named now, before the first step
    return DeviceBatches(loader, partial(to_device, device=device, decoder=decoder), device)


def train_loader(train_set, cfg, start: int, stop: int, world: int = 1, rank: int = 0, pin: bool = False,
                 device: torch.device | None = None):
    d = cfg.data
    sampler = ShardedBatches(len(train_set), d.batch_size, world, rank, cfg.train.seed, start, stop,
                             order=getattr(train_set, "epoch_order", None))
    ds = Samples(train_set, d.image_size, Augment(d.augment, cfg.train.seed) if d.augment else None,
                 encoded=d.decode == "device")
    return device_loader(make_loader(ds, sampler, d.workers, d.prefetch, pin), cfg, pin, device), sampler


def test_loader(test_set, cfg, pin: bool = False, rank: int = 0, world: int = 1, device: torch.device | None = None):
    """This worker's slice of the test set (every world-th image from `rank`): the workers
    evaluate their slices at once and sum what they count."""
    mine, b = list(range(rank, len(test_set), world)), max(cfg.data.batch_size, 64)
    batches = [[(i, 0) for i in mine[lo:lo + b]] for lo in range(0, len(mine), b)]
    ds = Samples(test_set, cfg.data.image_size, encoded=cfg.data.decode == "device")
    return device_loader(make_loader(ds, batches, cfg.data.workers, cfg.data.prefetch, pin), cfg, pin, device)
