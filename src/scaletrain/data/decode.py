"""Encoded images to uint8 RGB pixels, at no more resolution than a crop needs.

JPEGs go through simplejpeg (libjpeg-turbo, the same library Pillow wraps,
with identical output), faster than Pillow: it returns a NumPy array without
Pillow's image object and copy. When the crop's side is at least twice the
network input, libjpeg-turbo decodes at 1/2, 1/4 or 1/8 scale, doing that
much less inverse-DCT work. Other formats, and JPEGs libjpeg-turbo warns
about (then Pillow decides, as before), go through Pillow. The resize runs on
torch's uint8 kernels (antialiased bilinear), faster than Pillow's on the
same crop; images stay uint8, four times fewer bytes than float32, until the
device normalises them in batches (loader.Prepare).
"""

from __future__ import annotations

import io

import numpy as np
import torch
import torch.nn.functional as F

JPEG_MAGIC = b"\xff\xd8"


def image_size(data: bytes) -> tuple[int, int]:
    """(width, height) from the header alone."""
    if data[:2] == JPEG_MAGIC:
        import simplejpeg  # here: only image files need it; a broken install fails just the jobs reading them
        try:
            h, w, _, _ = simplejpeg.decode_jpeg_header(data)
            return w, h
        except ValueError:
            pass  # Pillow reads what libjpeg-turbo's header parser refuses, or fails naming why
    with _opened(data) as im:
        return im.size


def decode(data: bytes, min_size: tuple[int, int] = (0, 0)) -> np.ndarray:
    """HWC uint8 RGB, reduced by the largest power of two (at most 8) that keeps it at
    least `min_size` (width, height) for JPEGs; full size otherwise. Raises on corrupt data."""
    if data[:2] == JPEG_MAGIC:
        import simplejpeg  # here: only image files need it; a broken install fails just the jobs reading them
        try:
            # strict: any libjpeg-turbo warning raises, rather than decoding grey blocks
            return simplejpeg.decode_jpeg(data, colorspace="RGB", min_width=min_size[0],
                                          min_height=min_size[1], strict=True)
        except ValueError:
            pass  # Pillow judges as it always has: benign warnings pass, a truncated stream raises
    with _opened(data) as im:
        if min_size[0] and im.format == "JPEG":
            im.draft("RGB", min_size)
        return np.array(im.convert("RGB"))  # writable, for torch.from_numpy


def _opened(data: bytes):
    """Pillow's image of `data`. Bytes of no format it knows raise UnidentifiedImageError, whose own
    message names the in-memory buffer (`<_io.BytesIO object at 0x...>`), which says nothing to a
    user: raised again saying what the bytes are not (the caller names the file)."""
    from PIL import Image, UnidentifiedImageError  # here: only image files need it (a broken install fails only them)

    try:
        return Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        raise UnidentifiedImageError(f"not an image of a format Pillow reads (JPEG, PNG, BMP, WebP, ...); "
                                     f"it starts with {bytes(data[:8])!r}") from None


def fit(pixels: torch.Tensor, box: tuple[int, int, int, int], size: int) -> torch.Tensor:
    """The box (top, left, height, width) of an HWC uint8 image, resized to size x size (HWC uint8)."""
    top, left, h, w = box
    crop = pixels[top:top + h, left:left + w]
    if h == w == size:
        return crop
    # channels-last NCHW over HWC memory: torch's vectorised uint8 kernel, and an output whose
    # HWC view is contiguous (the batch stack then copies without reordering)
    x = crop.unsqueeze(0).permute(0, 3, 1, 2).contiguous(memory_format=torch.channels_last)
    y = F.interpolate(x, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
    return y[0].permute(1, 2, 0)


def load(data: bytes, box_of, size: int) -> torch.Tensor:
    """Decode `data` and fit the box `box_of(width, height)` chooses to size x size.

    The decode is reduced by the largest power of two (2, 4, 8; the scales libjpeg-turbo
    decodes fastest) that leaves the box at least `size` pixels on each side."""
    w, h = image_size(data)
    box = box_of(w, h)
    pixels = decode(data, least_size(box, (w, h), size))
    return fit(torch.from_numpy(pixels), reduced_box(box, (w, h), pixels.shape[1::-1]), size)


def least_size(box: tuple[int, int, int, int], full: tuple[int, int], size: int) -> tuple[int, int]:
    """The (width, height) a decode of a (width, height) image may shrink to, as decode's min_size: by the
    largest power of two (2, 4, 8; the scales libjpeg-turbo decodes fastest) that leaves the box
    (top, left, height, width) at least `size` pixels on each side; (0, 0), full size, when none does."""
    (_, _, bh, bw), (w, h) = box, full
    k = 1
    while k < 8 and min(bw, bh) >= 2 * k * size:
        k *= 2
    return (-(-w // k), -(-h // k)) if k > 1 else (0, 0)


def reduced_box(box: tuple[int, int, int, int], full: tuple[int, int], reduced: tuple[int, int]):
    """The box (top, left, height, width) of a (width, height) image in the pixels of its reduced
    decode (width, height), kept inside it and at least one pixel on each side."""
    (top, left, bh, bw), (w, h), (fw, fh) = box, full, reduced
    if (fw, fh) == (w, h):
        return box
    sy, sx = fh / h, fw / w
    top, left = int(top * sy), int(left * sx)
    return top, left, max(1, min(fh - top, round(bh * sy))), max(1, min(fw - left, round(bw * sx)))
