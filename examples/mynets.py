"""A network of your own for a recipe: model.name = "mynets:vgg" (this folder on PYTHONPATH).

The factory is called with num_classes and the keys of the recipe's [model.args]; it returns any
torch.nn.Module whose output is (batch, num_classes).
"""

from torch import nn


def vgg(num_classes: int, width: int = 16, depth: int = 2) -> nn.Sequential:
    """VGG-style: `depth` stages of two 3x3 convolutions and a max-pool, doubling the channels."""
    layers, channels = [], 3
    for stage in range(depth):
        out = width * 2 ** stage
        layers += [nn.Conv2d(channels, out, 3, padding=1), nn.BatchNorm2d(out), nn.ReLU(),
                   nn.Conv2d(out, out, 3, padding=1), nn.BatchNorm2d(out), nn.ReLU(), nn.MaxPool2d(2)]
        channels = out
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, num_classes))
