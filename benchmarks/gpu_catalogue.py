"""The GPU catalogue's achieved-rate factors, fitted and checked on a network not fitted to.

Each factor (perfmodel/gpus.py, FACTOR) is the fraction of the roofline bound of ResNet-50's
training step that a published single-GPU measurement reached (gpus.POINTS). The check predicts
ResNeXt-101 32x4d (gpus.CHECKS: the same tables, same GPUs and modes) from those factors alone:
grouped convolutions move far more bytes per FLOP than ResNet-50's, so a FLOPs-only factor would
call it nearly as fast per FLOP, where the roofline charges its bytes. Prints one JSON object:
the factors, each check's predicted and published img/s and error, and the errors' median and
maximum (the catalogue's held-out error, which cluster descriptions carry as their compute band).
Counting the networks on the meta device takes about half a minute.

    python benchmarks/gpu_catalogue.py [--save]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

from scaletrain.config import load_config
from scaletrain.metrics import git_commit, run_info
from scaletrain.perfmodel import gpus
from scaletrain.perfmodel.layers import step_cost

ROOT = Path(__file__).resolve().parents[1]


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


NETWORKS = {"resnet50": "resnet50", "resnext101-32x4d": "gpu_catalogue:resnext101_32x4d"}


def cost(point: gpus.Point, cache: dict):
    key = (point.model, point.batch, point.mode == "half")
    if key not in cache:
        cfg = load_config(None, [f"model.name={NETWORKS[point.model]}", "model.num_classes=1000"])
        cache[key] = step_cost(cfg.model, 224, point.batch, half=point.mode == "half")
    return cache[key]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--save", action="store_true", help="also write benchmarks/results/gpu-catalogue-TIME-COMMIT.json")
    args = ap.parse_args()
    cache: dict = {}
    factors, flops_factor = {}, {}
    for p in gpus.POINTS:
        print(f"fitting {p.gpu} {p.mode} on {p.model} at batch {p.batch}", file=sys.stderr)
        c, g = cost(p, cache), gpus.gpu(p.gpu)
        factors[f"{p.gpu}/{p.mode}"] = round(gpus.fit(c, g, p.mode, p.images_per_s), 4)
        # the FLOPs-only alternative: the fraction of peak FLOP/s ResNet-50 reached, carried over as it is
        flops_factor[(p.gpu, p.mode)] = c.flops / g.peak[p.mode] / (p.batch / p.images_per_s)
    gpus.FACTOR.update({tuple(k.split("/")): v for k, v in factors.items()})
    checks = []
    for p in gpus.CHECKS:
        print(f"checking {p.gpu} {p.mode} on {p.model} at batch {p.batch}", file=sys.stderr)
        c, g = cost(p, cache), gpus.gpu(p.gpu)
        got = p.batch / gpus.step_s(c, g, p.mode, gpus.factor(g, p.mode)[0])
        flops_only = p.batch / (c.flops / (g.peak[p.mode] * flops_factor[(p.gpu, p.mode)]))
        checks.append({"gpu": p.gpu, "mode": p.mode, "model": p.model, "batch": p.batch,
                       "published": p.images_per_s, "predicted": round(got, 1),
                       "error": round(got / p.images_per_s - 1, 4),
                       "flops_only_predicted": round(flops_only, 1),
                       "flops_only_error": round(flops_only / p.images_per_s - 1, 4), "source": p.source})
    errors = [abs(c["error"]) for c in checks]
    flops_errors = [abs(c["flops_only_error"]) for c in checks]
    out = {"benchmark": "gpu_catalogue", "factors": factors,
           "fitted_to": [vars(p) for p in gpus.POINTS], "checks": checks,
           "held_out_error": {"median": round(statistics.median(errors), 4), "max": round(max(errors), 4)},
           "flops_only_held_out_error": {"median": round(statistics.median(flops_errors), 4),
                                         "max": round(max(flops_errors), 4)},
           "launch_s": gpus.LAUNCH_S, **run_info(torch.device("cpu"))}
    text = json.dumps(out, indent=1)
    print(text)
    if args.save:
        path = ROOT / "benchmarks/results" / f"gpu-catalogue-{time.strftime('%Y-%m-%dT%H%MZ', time.gmtime())}-{git_commit()[:7]}.json"
        path.write_text(text + "\n")
        print(f"saved {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
