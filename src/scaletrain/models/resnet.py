"""The ResNet family (He et al., 2015), written against torch.nn only.

resnet18/resnet50 follow the ImageNet layout (7x7 stem, max-pool, stages of
64-128-256-512 channels; basic blocks 2-2-2-2, bottlenecks 3-4-6-3) with the
stride on the 3x3 convolution of a bottleneck ("v1.5"), the layout pretrained
checkpoints use. resnet8/resnet20 are the CIFAR-style nets (3x3 stem, three
stages of n basic blocks, depth 6n+2) for small images and CPU work.
Parameter names match the common torchvision naming, so state dicts load.
"""

from __future__ import annotations

from functools import partial
from math import gcd

import torch
from torch import nn


def norm_layer(kind: str, channels: int) -> nn.Module:
    if kind == "batch":
        return nn.BatchNorm2d(channels)
    # 32 groups as in Wu & He (2018), fewer when the channel count is small.
    return nn.GroupNorm(gcd(32, channels), channels)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, cin: int, planes: int, stride: int, norm) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, planes, 3, stride, 1, bias=False)
        self.bn1 = norm(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = norm(planes)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = _shortcut(cin, planes, stride, norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + (x if self.downsample is None else self.downsample(x)))


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, planes: int, stride: int, norm) -> None:
        super().__init__()
        out = planes * 4
        self.conv1 = nn.Conv2d(cin, planes, 1, bias=False)
        self.bn1 = norm(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)
        self.bn2 = norm(planes)
        self.conv3 = nn.Conv2d(planes, out, 1, bias=False)
        self.bn3 = norm(out)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = _shortcut(cin, out, stride, norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + (x if self.downsample is None else self.downsample(x)))


def _shortcut(cin: int, cout: int, stride: int, norm) -> nn.Module | None:
    if stride == 1 and cin == cout:
        return None
    return nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), norm(cout))


class ResNet(nn.Module):
    def __init__(self, block, layers: list[int], num_classes: int, norm: str = "batch",
                 widths: tuple[int, ...] = (64, 128, 256, 512), small_input: bool = False) -> None:
        super().__init__()
        norm_fn = partial(norm_layer, norm)
        c = widths[0]
        if small_input:  # CIFAR stem: keep resolution for 8-32 px inputs
            self.conv1 = nn.Conv2d(3, c, 3, 1, 1, bias=False)
            self.maxpool = nn.Identity()
        else:
            self.conv1 = nn.Conv2d(3, c, 7, 2, 3, bias=False)
            self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.bn1 = norm_fn(c)
        self.relu = nn.ReLU(inplace=True)
        cin = c
        for i, (n, w) in enumerate(zip(layers, widths), start=1):
            blocks = []
            for j in range(n):
                blocks.append(block(cin, w, 2 if (j == 0 and i > 1) else 1, norm_fn))
                cin = w * block.expansion
            setattr(self, f"layer{i}", nn.Sequential(*blocks))
        self.num_stages = len(layers)
        self.fc = nn.Linear(cin, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        # Zero the last norm of each residual branch: each block starts as the
        # identity, which trains large nets faster (Goyal et al., 2017).
        for m in self.modules():
            last = getattr(m, "bn3", None) if isinstance(m, Bottleneck) else (
                getattr(m, "bn2", None) if isinstance(m, BasicBlock) else None)
            if last is not None:
                nn.init.zeros_(last.weight)

    def pipeline_layers(self) -> list[tuple[str, nn.Module]]:
        """The layers in forward order, where pipeline stages may split it (pipeline.py): the stem, each
        residual block, the pooled classifier."""
        return [("stem", nn.Sequential(self.conv1, self.bn1, self.relu, self.maxpool)),
                *[(f"layer{i}.{j}", b) for i in range(1, self.num_stages + 1)
                  for j, b in enumerate(getattr(self, f"layer{i}"))],
                ("fc", nn.Sequential(GlobalMean(), self.fc))]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        for i in range(1, self.num_stages + 1):
            x = getattr(self, f"layer{i}")(x)
        # The global average as the mean it is: ATen computes a 1x1 adaptive pool so on every device, so
        # the adaptive-pool CUDA backward, which has no deterministic kernel, is never reached; written
        # out, train.deterministic on a GPU does not rest on that shortcut (tests/test_device.py).
        return self.fc(x.mean((2, 3)))


class GlobalMean(nn.Module):
    """The global average pool as a mean over the pixels (ResNet.forward says why)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean((2, 3))


def resnet(name: str, num_classes: int, norm: str = "batch", width: int = 16) -> ResNet:
    if name == "resnet50":
        return ResNet(Bottleneck, [3, 4, 6, 3], num_classes, norm)
    if name == "resnet18":
        return ResNet(BasicBlock, [2, 2, 2, 2], num_classes, norm)
    depth = {"resnet8": 8, "resnet20": 20}.get(name)
    if depth is None:
        raise ValueError(f"unknown model {name!r}")
    n = (depth - 2) // 6
    return ResNet(BasicBlock, [n] * 3, num_classes, norm, widths=(width, 2 * width, 4 * width), small_input=True)
