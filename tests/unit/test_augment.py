"""Augmentations and the uint8 path: each augmentation is deterministic per (seed, epoch,
sample), keeps shape and value range, and does something; uint8 pixels normalised on the
device equal the per-image float path."""

import io

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from scaletrain.config import ConfigError, load_config
from scaletrain.recipe_values import AUGMENTATIONS
from scaletrain.data import Prepare
from scaletrain.data.augment import ASPECT, Augment, centre
from scaletrain.data.decode import decode, image_size, load, reduced_box
from scaletrain.data.loader import Samples, collate
from scaletrain.data.sources import IMAGENET

from conftest import RECIPES

SIZE = 32


class Photos(torch.utils.data.Dataset):
    """A few smooth 120x90 JPEGs (what a loader reads from a file), as FileDataset returns them."""

    stats = IMAGENET

    def __init__(self, n=8):
        yy, xx = np.mgrid[0:90, 0:120] / 90.0
        self.items = []
        for i in range(n):
            img = np.stack([np.sin(3 * xx + i), np.cos(2 * yy - i), np.sin(xx * yy * 4 + i)], -1) * 110 + 128
            buf = io.BytesIO()
            Image.fromarray(img.astype(np.uint8)).save(buf, "JPEG", quality=90)
            self.items.append(buf.getvalue())

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i], i % 3

    def name(self, i):
        return f"photo {i}"


def batch(names, epoch=0, seed=5, n=8):
    ds = Samples(Photos(n), SIZE, Augment(names, seed) if names else None)
    return collate([ds[(i, epoch)] for i in range(n)])


def prepared(names, **kw):
    b = batch(names, **kw)
    x, _ = Prepare(names, IMAGENET, torch.device("cpu"))(b)
    return x


LOW = (-torch.tensor(IMAGENET[0]) / torch.tensor(IMAGENET[1])).view(1, 3, 1, 1)
HIGH = ((1 - torch.tensor(IMAGENET[0])) / torch.tensor(IMAGENET[1])).view(1, 3, 1, 1)


@pytest.mark.parametrize("name", AUGMENTATIONS)
def test_each_augmentation_is_seeded_keeps_shape_and_range_and_acts(name):
    x = prepared([name])
    assert x.shape == (8, 3, SIZE, SIZE) and x.dtype == torch.float32
    assert torch.equal(x, prepared([name]))  # the same (seed, epoch, sample): the same image
    assert (x >= LOW - 1e-5).all() and (x <= HIGH + 1e-5).all()  # pixels stay within [0, 1] before normalising
    plain = prepared([])
    changed = [not torch.equal(x[i], plain[i]) for i in range(8)]
    assert sum(changed) >= (3 if name == "flip" else 7)  # flip acts on about half of the samples
    assert not torch.equal(x, prepared([name], epoch=1))  # another epoch, other draws
    assert not torch.equal(x, prepared([name], seed=6))


def test_all_augmentations_together_are_seeded_and_in_range():
    x = prepared(list(AUGMENTATIONS))
    assert torch.equal(x, prepared(list(AUGMENTATIONS)))
    assert (x >= LOW - 1e-5).all() and (x <= HIGH + 1e-5).all() and x.shape == (8, 3, SIZE, SIZE)


def test_one_augmentation_does_not_change_what_another_draws():
    a = batch(["resized-crop", "flip"])
    b = batch(["resized-crop", "flip", "color"])
    assert torch.equal(a.x, b.x)  # the colour cast is the device's; the loader's crops are the same


def test_resized_crop_boxes_have_the_stated_area_and_aspect():
    aug = Augment(["resized-crop"], seed=0)
    for i in range(300):
        top, left, h, w = aug.box(aug.draws(0, i), 500, 375)
        assert 0 <= top and top + h <= 375 and 0 <= left and left + w <= 500
        assert 0.08 * 0.95 <= w * h / (500 * 375) <= 1.0
        assert ASPECT[0] * 0.97 <= w / h <= ASPECT[1] * 1.03
    assert aug.box(aug.draws(0, 0), 2000, 40)[2:] == (40, 53)  # no try fits: the whole height, aspect 4/3
    assert centre(500, 375) == (0, 62, 375, 375)


def test_uint8_device_path_equals_the_float_path():
    """Per image in float (the previous path: normalise, then pad-and-crop and flip) against uint8
    crops and flips in the loader and normalisation on the device, in a batch."""
    names = ["crop", "flip"]
    ds, aug = Photos(), Augment(names, 5)
    got = prepared(names)
    mean, std = (torch.tensor(v, dtype=torch.float64).view(3, 1, 1) for v in IMAGENET)
    for i in range(len(ds)):
        pixels = load(ds[i][0], centre, SIZE)  # the decoded, resized picture both paths start from
        x = (pixels.permute(2, 0, 1).double() / 255 - mean) / std
        u = aug.draws(0, i)
        pad = SIZE // 8
        dy, dx = (int(v * (2 * pad + 1)) for v in u[40:42].tolist())
        x = F.pad(x.unsqueeze(0), (pad,) * 4, mode="reflect")[0, :, dy:dy + SIZE, dx:dx + SIZE]
        if u[42] < 0.5:
            x = x.flip(-1)
        assert (got[i].double() - x).abs().max() < 1e-6


def test_reduced_scale_decode_keeps_the_box_and_size():
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (600, 800, 3), dtype=np.uint8)).save(buf, "JPEG")
    data = buf.getvalue()
    assert image_size(data) == (800, 600)
    assert decode(data, (100, 75)).shape == (75, 100, 3)  # 1/8 scale
    # A smooth picture, so that a box 10 pixels off (about one output pixel) scores worse than the
    # right one: noise averages out under any box.
    yy, xx = np.mgrid[0:600, 0:800]
    smooth = np.stack([xx * 255 // 799, yy * 255 // 599, 127 + 100 * np.sin(xx / 40) * np.cos(yy / 50)], -1)
    buf = io.BytesIO()
    Image.fromarray(smooth.astype(np.uint8)).save(buf, "JPEG", quality=95)
    data = buf.getvalue()
    full = load(data, centre, 64)  # the 600-pixel centre square at 1/4 scale, then resized
    assert full.shape == (64, 64, 3)
    pixels = torch.from_numpy(decode(data)).permute(2, 0, 1)[None].float()

    def error(x0: int) -> float:
        ref = F.interpolate(pixels[..., x0:x0 + 600], size=(64, 64), mode="bilinear", antialias=True,
                            align_corners=False)[0].permute(1, 2, 0)
        return (full.float() - ref).abs().mean().item()

    assert error(100) < 2.5 and error(100) < min(error(90), error(110))  # 1.8 against 2.8 and 6.1


@pytest.mark.parametrize("box,full,reduced,expected", [
    ((0, 100, 600, 600), (800, 600), (200, 150), (0, 25, 150, 150)),    # the centre square at 1/4
    ((37, 211, 402, 380), (800, 600), (100, 75), (4, 26, 50, 48)),      # a crop at 1/8: truncated corner
    ((0, 0, 601, 801), (801, 601), (401, 301), (0, 0, 301, 401)),       # odd sides round up, kept inside
    ((599, 799, 1, 1), (800, 600), (100, 75), (74, 99, 1, 1)),          # a corner pixel stays a pixel
    ((10, 20, 30, 40), (800, 600), (800, 600), (10, 20, 30, 40)),       # no reduction: the box itself
])
def test_a_box_in_the_reduced_decode_is_the_same_part_of_the_picture(box, full, reduced, expected):
    """The pixel test above can only see a box several pixels off (a reduced decode samples
    differently from a resize); this one sees one reduced pixel."""
    assert reduced_box(box, full, reduced) == expected


def test_bad_bytes_become_a_named_bad_image():
    class Broken(Photos):
        def __getitem__(self, i):
            return b"\xff\xd8 broken", 0

    item = Samples(Broken(1), SIZE)[(0, 0)]
    assert item.path == "photo 0" and "Error" in item.reason


def test_augment_key_accepts_lists_words_and_false():
    def aug(v):
        return load_config(RECIPES / "digits.toml", [f"data.augment={v}"]).data.augment

    assert aug('["flip", "resized-crop"]') == ["resized-crop", "flip"]
    assert aug("crop+flip") == ["crop", "flip"] and aug("false") == [] and aug("[]") == [] and aug("none") == []
    with pytest.raises(ConfigError, match=r"data.augment = .*'blur' is not an augmentation; choose from resized-crop"):
        aug("blur")


def test_the_largest_seed_draws():
    aug = Augment(["flip"], seed=2**31 - 1)
    assert aug.draws(90, 10**7).shape == aug.draws(0, 0).shape and not torch.equal(aug.draws(0, 1), aug.draws(0, 2))
