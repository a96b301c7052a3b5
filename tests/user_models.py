"""Networks a researcher might bring, named by import path in the tests (model.name =
"user_models:FACTORY"); tests put this folder on PYTHONPATH for the job's processes.

Both are small (about two thousand parameters) for 8x8 or 16x16 digits. `plain` has no
normalisation: its gradient over a batch is the mean of its replicas' gradients, so the strategies
equal one process exactly. `batchnorm` has BatchNorm layers and their buffers. The rest are broken
on purpose, one way each, for the errors of models/factory.py.
"""

from torch import nn


def plain(num_classes: int, width: int = 8) -> nn.Sequential:
    """VGG-style: 3x3 convolutions and max-pools, a linear classifier on the channels' means."""
    return nn.Sequential(
        nn.Conv2d(3, width, 3, padding=1), nn.ReLU(),
        nn.Conv2d(width, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * width, num_classes))


class BatchNormNet(nn.Module):
    """Convolutions with BatchNorm (running mean and variance: buffers), a head named `classifier`."""

    def __init__(self, num_classes: int, width: int = 8) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1, bias=False), nn.BatchNorm2d(2 * width), nn.ReLU())
        self.classifier = nn.Linear(2 * width, num_classes)

    def forward(self, x):
        return self.classifier(self.features(x).mean((2, 3)))


def batchnorm(num_classes: int, width: int = 8) -> BatchNormNet:
    return BatchNormNet(num_classes, width)


def raises(num_classes: int) -> nn.Module:
    raise ValueError(f"no network for {num_classes} classes today")


def not_a_module(num_classes: int) -> list:
    return [nn.Linear(3, num_classes)]


def lazy(num_classes: int) -> nn.Module:
    """Its last layer's input size left to the first forward (nn.LazyLinear)."""
    return nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.LazyLinear(num_classes))


def wrong_output(num_classes: int) -> nn.Module:
    """Forgets the class count: (batch, num_classes + 1)."""
    return nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(3, num_classes + 1))


def fixed_size(num_classes: int) -> nn.Module:
    """A classifier on the flattened 16x16 image: any other image size fails in the forward."""
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, num_classes))


# A network, not a factory. Made as the module is imported, it draws random numbers then: the job's
# initial network must not depend on whether a process imported the module before it was seeded.
instance = plain(10)


def reads_values(num_classes: int) -> nn.Module:
    """Reads a tensor's value as it builds (as a factory that loads its own weights would): it cannot
    be built on the meta device."""
    net = plain(num_classes)
    scale = float(net[0].weight.abs().max().item())
    return net if scale >= 0 else None
