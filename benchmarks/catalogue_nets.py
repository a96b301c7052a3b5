"""Networks of the GPU catalogue's checks that scaletrain's models do not build, on torch alone
(benchmarks/gpu_rates.py imports this on a GPU machine that has nothing but torch)."""

from __future__ import annotations

import torch
from torch import nn


class _Block(nn.Module):
    """ResNeXt's bottleneck (Xie et al. 2017, v1.5 stride in the grouped 3x3), as DeepLearningExamples builds it."""

    def __init__(self, cin: int, width: int, cout: int, stride: int, groups: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, width, 3, stride, 1, groups=groups, bias=False), nn.BatchNorm2d(width),
            nn.ReLU(inplace=True), nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout))
        self.short = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                      if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x):
        return torch.relu(self.body(x) + self.short(x))


def resnext101_32x4d(num_classes: int = 1000) -> nn.Module:
    layers, groups, base = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
                            nn.MaxPool2d(3, 2, 1)], 32, 4
    cin = 64
    for i, (n, planes) in enumerate(zip((3, 4, 23, 3), (64, 128, 256, 512))):
        width = groups * base * planes // 64
        for j in range(n):
            layers.append(_Block(cin, width, planes * 4, 2 if (j == 0 and i > 0) else 1, groups))
            cin = planes * 4
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, num_classes))
