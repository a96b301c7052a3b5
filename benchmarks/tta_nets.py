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


def vgg_small(num_classes: int = 10) -> nn.Module:
    """A small VGG-style CNN, BN-free too: two blocks of two convolutions and a max-pool, then two linear
    layers with dropout. Added after the method (three update sizes, every seed's runs fitted at once)
    was settled on plain_cnn, to check it on a network it was not developed on."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(32 * 16, 64), nn.ReLU(), nn.Dropout(0.2),
        nn.Linear(64, num_classes))
