"""The input's part on the training process's device: decoding there (data.decode = "device"), and
each batch brought to the device ahead of its step.

With data.decode = "device" the loader processes do no pixel work on JPEGs: they read a sample's
bytes, its size from the header, and draw its box and moves from augment.py's per-sample draws,
as the host path does. The training process then, a batch at a time, on its device:
  decode  every JPEG of the batch in one call (decoder_for): nvJPEG through torchvision.io on a
          GPU; on a CPU device libjpeg-turbo, the loader path's own decoder (decode.decode), so
          the same path runs and is tested on machines without a GPU
  fit     each image's box resized to the input side, antialiased bilinear (fit)
  move    crop's shift and flip for the whole batch in one gather (move)
and Prepare goes on as for every batch (floats, the float augmentations, normalisation). What the
loader cannot hand over as JPEG bytes (other formats, pixels of a tensor dataset) it decodes and
fits itself as before, and those samples join the batch at the move. A JPEG nvJPEG refuses (CMYK,
a stream its parser rejects) is decoded on the host instead, with a warning naming it; one neither
decodes is a BadImage like any unreadable file (data.on_bad_image).

On a CUDA device the host's part of every batch is taken off the step's critical path
(DeviceBatches): batches come from pinned memory, and the next batch is copied, and with
data.decode = "device" decoded, on a side stream while the current step computes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import ConfigError
from ..imports import one_line
from ..models.factory import extra_error
from . import decode
from .sources import BadImage

log = logging.getLogger("scaletrain")


@dataclass
class Jpeg:
    """One sample as the loader passes it under data.decode = "device": its bytes and where to cut."""
    data: bytes
    box: tuple[int, int, int, int]  # top, left, height, width, in the full image
    full: tuple[int, int]           # the image's width, height (from the header)
    size: int                       # the network input's side
    name: str                       # the file or sample, for a BadImage


@dataclass
class Encoded:
    """A batch's images before decoding: the JPEGs' bytes end to end (one buffer: one shared-memory
    block between processes, not one a sample), and the samples the loader already fitted."""
    data: torch.Tensor      # uint8, every JPEG stream of the batch in batch order
    lengths: list[int]      # bytes of each stream
    boxes: list[tuple]      # per JPEG: (box, full) as in Jpeg
    names: list[str]        # per JPEG, as in Jpeg
    jpeg_at: list[int]      # each JPEG's position in the batch
    pixels: torch.Tensor    # n x size x size x 3 uint8, fitted by the loader
    pixels_at: list[int]    # their positions in the batch
    moves: torch.Tensor     # batch x 3 int64: crop's dy, dx and flip (augment.Augment.moves)
    size: int

    def pin_memory(self) -> "Encoded":
        # the JPEG bytes stay pageable: nvJPEG and libjpeg-turbo read them on the host
        return replace(self, pixels=self.pixels.pin_memory(), moves=self.moves.pin_memory())


def collate_encoded(good: list) -> Encoded:
    """Encoded of (image, label, params, move) samples, image a Jpeg or fitted HWC uint8 pixels."""
    jpegs = [(k, g[0]) for k, g in enumerate(good) if isinstance(g[0], Jpeg)]
    pix = [(k, g[0]) for k, g in enumerate(good) if not isinstance(g[0], Jpeg)]
    lengths = [len(j.data) for _, j in jpegs]
    data = torch.empty(sum(lengths), dtype=torch.uint8)
    flat, at = data.numpy(), 0
    for (_, j), n in zip(jpegs, lengths):
        flat[at:at + n] = np.frombuffer(j.data, dtype=np.uint8)
        at += n
    size = jpegs[0][1].size if jpegs else pix[0][1].shape[0]
    pixels = torch.stack([p for _, p in pix]) if pix else torch.empty(0, size, size, 3, dtype=torch.uint8)
    return Encoded(data, lengths, [(j.box, j.full) for _, j in jpegs], [j.name for _, j in jpegs],
                   [k for k, _ in jpegs], pixels, [k for k, _ in pix],
                   torch.tensor([g[3] for g in good], dtype=torch.int64), size)


# -- decoders: a list of 1-D uint8 CPU tensors (JPEG streams) -> HWC uint8 images on the device --

def host_decoder(streams: list[torch.Tensor], least: list[tuple[int, int]], device: torch.device) -> list:
    """libjpeg-turbo (decode.decode), at the reduced scale `least` allows as the loader path decodes; an
    exception in place of an image that does not decode."""
    out = []
    for s, m in zip(streams, least):
        try:
            out.append(torch.from_numpy(decode.decode(s.numpy().tobytes(), m)).to(device))
        except Exception as e:  # noqa: BLE001 - any decoder failure makes the image unreadable
            out.append(e)
    return out


def nvjpeg_decoder(streams: list[torch.Tensor], least: list[tuple[int, int]], device: torch.device) -> list:
    """nvJPEG through torchvision.io.decode_jpeg, the whole batch in one call; full size (nvJPEG has no
    reduced-scale decode). The call queues the decode on torchvision's own stream and makes the current
    stream wait for it; it also waits on the host for the previous call's decode."""
    decode_jpeg, rgb = torchvision_io()
    try:
        return [im.permute(1, 2, 0) for im in decode_jpeg(streams, mode=rgb, device=device)]
    except RuntimeError:
        pass  # one stream it cannot decode fails the whole call: decode them one by one to find it
    out = []
    for s, m in zip(streams, least):
        try:
            out.append(decode_jpeg(s, mode=rgb, device=device).permute(1, 2, 0))
        except RuntimeError as e:
            got = host_decoder([s], [m], device)[0]
            if not isinstance(got, Exception):
                log.warning("nvJPEG cannot decode a JPEG of this batch (%s); decoded on the host", one_line(e))
            out.append(got)
    return out


def torchvision_io():
    """(torchvision.io.decode_jpeg, ImageReadMode.RGB), or a ConfigError in one line saying what to install."""
    try:
        from torchvision.io import ImageReadMode, decode_jpeg  # optional extra, with no build for CPU-only machines
    except Exception as e:  # noqa: BLE001 - missing, or installed but built for another torch
        raise ConfigError(f"data.decode = 'device' on a GPU decodes with nvJPEG through torchvision, and "
                          f"{extra_error('torchvision', e, torch.__version__)}; or set data.decode = 'loader'") from None
    return decode_jpeg, ImageReadMode.RGB


def decoder_for(device: torch.device):
    """The decoder of data.decode = "device" on this device: nvJPEG on CUDA, libjpeg-turbo elsewhere."""
    return nvjpeg_decoder if device.type == "cuda" else host_decoder


# -- fit and move: pure tensor work, the same on every device --

def fit(pixels: torch.Tensor, box: tuple[int, int, int, int], size: int) -> torch.Tensor:
    """decode.fit on any device: torch's uint8 antialiased kernel where it exists (the CPU: the loader
    path's pixels exactly), else the float kernel rounded back to uint8 (within a level of it)."""
    if pixels.device.type == "cpu":
        return decode.fit(pixels, box, size)
    return fit_float(pixels, box, size)


def fit_float(pixels: torch.Tensor, box: tuple[int, int, int, int], size: int) -> torch.Tensor:
    """The box (top, left, height, width) of HWC uint8 pixels resized to size x size through floats
    (CUDA's antialiased bilinear kernel takes no uint8)."""
    top, left, h, w = box
    crop = pixels[top:top + h, left:left + w]
    if h == w == size:
        return crop
    x = crop.permute(2, 0, 1).unsqueeze(0).float()
    y = F.interpolate(x, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
    return y[0].round_().clamp_(0, 255).to(torch.uint8).permute(1, 2, 0)


def _reflect(j: torch.Tensor, n: int) -> torch.Tensor:
    """Indices mirrored into [0, n) without repeating the edge (augment._shift's border)."""
    return torch.where(j < 0, -j, torch.where(j >= n, 2 * n - 2 - j, j))


def move(x: torch.Tensor, moves: torch.Tensor) -> torch.Tensor:
    """augment.Augment.loader_ops of a whole N x S x S x 3 batch in one gather: sample k shifted by
    (dy, dx) = moves[k, :2], reflected at the border, then mirrored left-right when moves[k, 2]."""
    n, s = x.shape[:2]
    i = torch.arange(s, device=x.device)
    dy, dx, flip = moves.to(x.device, non_blocking=True).unbind(1)
    rows = _reflect(i + dy[:, None], s)
    cols = _reflect(torch.where(flip[:, None].bool(), s - 1 - i, i) + dx[:, None], s)
    return x[torch.arange(n, device=x.device)[:, None, None], rows[:, :, None], cols[:, None, :]]


def decode_batch(e: Encoded, device: torch.device, decoder=None) -> tuple[torch.Tensor, list[int], list[BadImage]]:
    """The batch's N x size x size x 3 uint8 pixels on `device`, decoded, fitted and moved; the positions
    kept, and a BadImage for each JPEG that would not decode."""
    decoder = decoder or decoder_for(device)
    least = [decode.least_size(box, full, e.size) for box, full in e.boxes]
    if device.type == "cuda":
        least = [(0, 0)] * len(least)  # nvJPEG decodes full size; the host fallback then matches it
    images = decoder(list(torch.split(e.data, e.lengths)), least, device) if e.lengths else []
    parts: dict[int, torch.Tensor] = {}
    failed = []
    for k, img, (box, full), name in zip(e.jpeg_at, images, e.boxes, e.names):
        if isinstance(img, Exception):
            failed.append(BadImage(name, one_line(img)))
        else:
            parts[k] = fit(img, decode.reduced_box(box, full, (img.shape[1], img.shape[0])), e.size)
    if e.pixels_at:
        pixels = e.pixels.to(device, non_blocking=True)
        parts.update((k, pixels[j]) for j, k in enumerate(e.pixels_at))
    keep = sorted(parts)
    x = torch.stack([parts[k] for k in keep]) if keep else \
        torch.empty(0, e.size, e.size, 3, dtype=torch.uint8, device=device)
    moves = e.moves[keep] if failed else e.moves
    return (move(x, moves) if len(keep) and bool(moves.any()) else x), keep, failed


def to_device(batch, device: torch.device, decoder=None):
    """A loader's Batch with its tensors on `device` (non-blocking from pinned memory), decoded there when
    it holds encoded images; samples that would not decode move to batch.bad."""
    move_ = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
    e = batch.encoded
    if e is None:
        return replace(batch, x=move_(batch.x), y=move_(batch.y), params=move_(batch.params))
    x, keep, failed = decode_batch(e, device, decoder)
    y, params = batch.y, batch.params
    if failed:  # new host tensors (pageable): only when a sample is dropped
        y, params = y[keep], None if params is None else params[keep]
    return replace(batch, x=x, y=move_(y), bad=list(batch.bad) + failed, params=move_(params), encoded=None)


class DeviceBatches:
    """A loader's batches on the device, through `stage` (to_device). On CUDA one batch ahead, on a side
    stream: the copy (and decode) of batch k+1 is queued while step k computes. The step's stream waits
    for the side stream before it uses a batch, and the batch's tensors are recorded on the step's
    stream so the caching allocator does not hand their memory to the side stream while the step
    still reads it."""

    def __init__(self, loader, stage, device: torch.device) -> None:
        self.loader, self.stage, self.device = loader, stage, device

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        it = iter(self.loader)
        if self.device.type != "cuda":
            for batch in it:
                yield self.stage(batch)
            return
        side = torch.cuda.Stream(self.device)
        main = torch.cuda.current_stream(self.device)
        ahead = self._queue(it, side)
        while ahead is not None:
            main.wait_stream(side)  # before batch k+1 is queued there: waits for batch k's copy only
            for t in (ahead.x, ahead.y, ahead.params):
                if t is not None and t.is_cuda:
                    t.record_stream(main)
            batch, ahead = ahead, self._queue(it, side)
            yield batch

    def _queue(self, it, side):
        try:
            batch = next(it)
        except StopIteration:
            return None
        with torch.cuda.stream(side):
            return self.stage(batch)
