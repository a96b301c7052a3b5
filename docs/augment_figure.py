"""docs/augmentations.png: one photograph under each training augmentation (data.augment).

scikit-learn's china.jpg, re-encoded as a JPEG, goes through the project's own path:
loader.Samples with an augment.Augment (decode, box, crop and flip on uint8 pixels) and
collate, then loader.Prepare for the device's part (rotation, lens, vignetting, color),
with identity channel statistics so the panel is the [0, 1] image the network's
normalisation would start from. Each panel's sample is, among the first CANDIDATES
sample indices of epoch 0, the one whose draw moves that augmentation furthest, so the
effect can be seen; its title gives the drawn value.

    python docs/augment_figure.py [--out docs/augmentations.png --size 224 --seed 0]
"""

from __future__ import annotations

import argparse
import io
import math
from pathlib import Path

import numpy as np
import torch

from scaletrain.recipe_values import AUGMENTATIONS
from scaletrain.data.augment import _CROP, _FLIP, MAX_CAST, MAX_DEGREES, MAX_LENS, MAX_VIGNETTE, ON_DEVICE, Augment
from scaletrain.data.loader import Prepare, Samples, collate

CANDIDATES = 20
BITS = (5, 6, 5)  # of R, G, B in the PNG: a 16-bit display's depth
IDENTITY = ((0.0, 0.0, 0.0), (1.0, 1.0, 1.0))  # Prepare's normalisation left out: the panel shows [0, 1]


class OnePhoto(torch.utils.data.Dataset):
    """The same encoded photograph at every index: a sample's look depends on its draw alone."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def __len__(self) -> int:
        return CANDIDATES

    def __getitem__(self, i: int):
        return self.data, 0

    def name(self, i: int) -> str:
        return f"china.jpg, sample {i}"


def photo() -> tuple[bytes, int, int]:
    from PIL import Image
    from sklearn.datasets import load_sample_image

    im = Image.fromarray(load_sample_image("china.jpg"))
    buf = io.BytesIO()
    im.save(buf, "JPEG", quality=90)
    return buf.getvalue(), im.width, im.height


def pick(names: list[str], seed: int, size: int, w: int, h: int) -> tuple[int, str]:
    """(sample index, title): the candidate whose draw for `names` is largest, and its value."""
    a = Augment(names, seed)
    u = [a.draws(0, i) for i in range(CANDIDATES)]
    p = [a.device_params(v) for v in u]
    name = names[0] if len(names) == 1 else "all"
    if name == "resized-crop":
        def area(i):
            _, _, bh, bw = a.box(u[i], w, h)
            return bh * bw
        i = min(range(CANDIDATES), key=area)  # the smallest box: the most zoomed-in
        _, _, bh, bw = a.box(u[i], w, h)
        return i, f"resized-crop {bw}x{bh} box ({100 * bw * bh / (w * h):.0f}% of area)"
    if name == "crop":
        pad = max(1, size // 8)  # the shift loader_ops draws (augment.Augment.loader_ops)
        shift = [tuple(int(v * (2 * pad + 1)) - pad for v in u[i][_CROP:_CROP + 2].tolist()) for i in range(CANDIDATES)]
        i = max(range(CANDIDATES), key=lambda i: abs(shift[i][0]) + abs(shift[i][1]))
        dy, dx = shift[i]  # output row r shows row r + dy: the picture moves by -dy
        return i, (f"crop: moved {abs(dy)} px {'up' if dy > 0 else 'down'}, "
                   f"{abs(dx)} px {'left' if dx > 0 else 'right'}")
    if name == "flip":
        return next(i for i in range(CANDIDATES) if u[i][_FLIP] < 0.5), "flip (mirrored)"
    if name == "rotation":
        i = max(range(CANDIDATES), key=lambda i: abs(p[i][0]))
        return i, f"rotation {math.degrees(p[i][0]):+.1f}°"
    if name == "lens":
        i = max(range(CANDIDATES), key=lambda i: abs(p[i][1]))
        return i, f"lens k={p[i][1]:+.2f} ({'barrel' if p[i][1] > 0 else 'pincushion'})"
    if name == "vignetting":
        i = max(range(CANDIDATES), key=lambda i: p[i][2])
        return i, f"vignetting v={p[i][2]:.2f}"
    if name == "color":
        i = max(range(CANDIDATES), key=lambda i: p[i][3:].abs().max())
        return i, "color ({:+d}, {:+d}, {:+d})".format(*(round(v * 255) for v in p[i][3:].tolist()))
    # all: the draw whose device effects are largest together, each as a fraction of its range
    score = [abs(q[0]) / math.radians(MAX_DEGREES) + abs(q[1]) / MAX_LENS + q[2] / MAX_VIGNETTE
             + q[3:].abs().max() * 255 / MAX_CAST for q in p]
    i = max(range(CANDIDATES), key=lambda i: score[i])
    q = p[i]
    return i, (f"all seven: {math.degrees(q[0]):+.1f}°, k={q[1]:+.2f}, v={q[2]:.2f},\n"
               "cast ({:+d}, {:+d}, {:+d})".format(*(round(v * 255) for v in q[3:].tolist())))


def panel(data: bytes, names: list[str], i: int, seed: int, size: int) -> torch.Tensor:
    """Sample i of epoch 0 through the loader and the device's part, as HWC floats in [0, 1]."""
    samples = Samples(OnePhoto(data), size, Augment(names, seed) if names else None)
    batch = collate([samples[(i, 0)]])
    x, _ = Prepare(names, IDENTITY, torch.device("cpu"))(batch)
    return x[0].permute(1, 2, 0).clamp(0, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "augmentations.png"))
    ap.add_argument("--size", type=int, default=224, help="network input side, pixels")
    ap.add_argument("--seed", type=int, default=0, help="train.seed")
    a = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from PIL import Image

    data, w, h = photo()
    panels = [([], 0, "none: the centre square")]
    for names in [[n] for n in AUGMENTATIONS] + [list(AUGMENTATIONS)]:
        panels.append((names, *pick(names, a.seed, a.size, w, h)))
    # each panel at its own pixels (size x size, no resampling), its title in a band above it
    side, gap, band = a.size, 8, 36
    fig = plt.figure(figsize=((3 * side + 4 * gap) / 100, 3 * (side + band + gap) / 100), dpi=100)
    W, H = fig.get_size_inches() * 100
    for k, (names, i, title) in enumerate(panels):
        r, c = divmod(k, 3)
        ax = fig.add_axes(((gap + c * (side + gap)) / W, 1 - (r + 1) * (side + band + gap) / H + gap / H,
                           side / W, side / H))
        ax.imshow(panel(data, names, i, a.seed, a.size).numpy(), interpolation="none")
        where = "device" if all(n in ON_DEVICE for n in names) else "loader" if len(names) == 1 else "both"
        ax.set_title(title + (f"\n(sample {i}, {where})" if names else ""), fontsize=7.5, pad=3)
        ax.axis("off")
    fig.canvas.draw()
    rgb = np.asarray(fig.canvas.buffer_rgba())[..., :3]
    plt.close(fig)
    # A photograph in PNG costs ~2 bytes a pixel; 5-6-5 bits (steps of 8, 4 and 8 in 255, not seen
    # at this size) take it from ~730 KB to ~420 KB. A 256-colour palette bands the colour panel's sky.
    step = 2 ** (8 - np.array(BITS))
    rgb = np.minimum((rgb.astype(np.int32) + step // 2) // step * step, 255).astype(np.uint8)
    Image.fromarray(rgb).save(a.out, optimize=True)
    print(a.out)


if __name__ == "__main__":
    main()
