"""A dataset of one's own, as a recipe names it: data.name = "user_data:FACTORY", with [data.args].

scikit-learn's 8x8 digits in both forms a factory may return, and factories that go wrong in each
way scaletrain names. The job's processes import this module too: a test that starts a job puts
tests/ on PYTHONPATH.
"""

import numpy as np
import torch


def _digits(count: int) -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits  # heavy (scipy): only the factories that are called need it

    d = load_digits()
    return d.images[:count] / 16.0, d.target[:count]


class Listed(torch.utils.data.Dataset):
    """Samples as given: (image, label) pairs, or whatever a broken dataset holds."""

    def __init__(self, samples) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i):
        return self.samples[i]


class Digits(Listed):
    """1 x 8 x 8 float tensors in [0, 1] and int labels; scaletrain holds out data.test_fraction."""

    classes = [f"digit {i}" for i in range(10)]

    def __init__(self, count: int = 600) -> None:
        x, y = _digits(count)
        images = torch.tensor(x, dtype=torch.float32).unsqueeze(1)
        super().__init__([(img, int(lab)) for img, lab in zip(images, y)])


def digits(count: int = 600) -> Digits:
    return Digits(count)


def digits_split(count: int = 600, test: int = 100, stats: bool = False):
    """(train, test, classes): 8 x 10 x 3 uint8 arrays (the digit padded at the sides, so the centre
    square is the digit) and NumPy integer labels; with `stats`, the train set's own statistics."""
    x, y = _digits(count)
    u8 = np.pad((x * 255).round().astype(np.uint8), ((0, 0), (0, 0), (1, 1)))[..., None].repeat(3, axis=-1)
    train, held = Listed(list(zip(u8[test:], y[test:]))), Listed(list(zip(u8[:test], y[:test])))
    if stats:
        train.stats = ((0.3, 0.3, 0.3), (0.4, 0.4, 0.4))
    return train, held, [str(i) for i in range(10)]


def raises(message: str = "no such folder") -> Digits:
    raise FileNotFoundError(message)


def number() -> int:
    return 3


def stream() -> torch.utils.data.IterableDataset:
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter([])

    return Stream()


def flat_images() -> Listed:
    """Images without a channel dimension: 8 x 8 float64 tensors."""
    return Listed([(torch.zeros(8, 8, dtype=torch.float64), 0)] * 20)


def unscaled() -> Listed:
    """Float images in [0, 255], not [0, 1]."""
    return Listed([(torch.full((3, 8, 8), 255.0), 0)] * 20)


def triples() -> Listed:
    return Listed([(torch.zeros(3, 8, 8), 0, "extra")] * 20)


def label_twelve() -> Listed:
    return Listed([(torch.zeros(3, 8, 8), 12)] * 20)


def bad_at(position: int = 7, count: int = 40) -> Listed:
    """Good samples but one, whose label is out of range: found when the loader reads it."""
    return Listed([(torch.zeros(3, 8, 8, dtype=torch.uint8), 12 if i == position else i % 10) for i in range(count)])


NOT_A_FUNCTION = 5
