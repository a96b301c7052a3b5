"""Networks the time-to-accuracy benchmark trains besides the built-in ResNets, by import path
(model.name = "tta_nets:plain_cnn", with benchmarks/ on PYTHONPATH)."""

from torch import nn


def plain_cnn(num_classes: int = 10) -> nn.Module:
    """A small CNN with no normalisation layer at all (BN-free): three convolutions and a linear
    layer, the kind a user brings for a first try on digits."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, num_classes))
