"""Throughput of `scaletrain train` against a bare PyTorch loop.

Same model, batch, synthetic data and optimizer; both exclude warm-up steps
and synchronise the device before reading the clock. Runs alternate
(bare, scaletrain, bare, ...) so drifts in machine load hit both; the figure
is the ratio of medians. Prints one JSON object.

On a GPU both use the same precision and memory format (--precision bf16: autocast
in the forward pass; --channels-last) and cuDNN's autotuner, as scaletrain does
outside train.deterministic.

    python benchmarks/overhead.py [--model resnet20 --image-size 32 --batch 64 --steps 60 --repeats 3]
                                  [--device cuda --precision bf16 --channels-last]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from contextlib import nullcontext

import torch

from scaletrain.config import build_config
from scaletrain.data import Prepare, build_datasets
from scaletrain.data.loader import collate
from scaletrain.metrics import run_info, sync
from scaletrain.models import build_model
from scaletrain.job import pick_device
from scaletrain.loop import train


def bare_loop(cfg, steps: int, warmup: int) -> float:
    """The loop a user would write by hand: tensors already in memory, no loader."""
    device = pick_device(cfg)
    cuda = device.type == "cuda"
    if cuda:
        torch.backends.cudnn.benchmark = True  # as scaletrain's non-deterministic runs
    fmt = torch.channels_last if cfg.train.channels_last and cuda else torch.contiguous_format
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cfg.train.precision == "bf16" and cuda \
        else nullcontext()
    torch.manual_seed(0)
    model = build_model(cfg.model).to(device, memory_format=fmt)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.optim.lr, momentum=cfg.optim.momentum,
                          weight_decay=cfg.optim.weight_decay)
    train_set, _, _ = build_datasets(cfg)
    b = cfg.data.batch_size
    batch = collate([(*train_set[i], None) for i in range(b)])  # uint8 pixels, made the network's input once
    xs, ys = Prepare([], train_set.stats, device, fmt is torch.channels_last)(batch)
    for i in range(warmup + steps):
        if i == warmup:
            sync(device)  # host-device sync: the clock starts after the warm-up's queued work
            t0 = time.perf_counter()
        with autocast:
            loss = torch.nn.functional.cross_entropy(model(xs).float(), ys)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    sync(device)
    return steps * b / (time.perf_counter() - t0)


def scaletrain_run(cfg) -> float:
    with tempfile.TemporaryDirectory() as d:
        return train(cfg, d, progress=False)["images_per_sec"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet20")
    ap.add_argument("--image-size", type=int, default=32)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workers", type=int, default=0, help="scaletrain loader processes")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16"), help="bf16: autocast, CUDA only")
    ap.add_argument("--channels-last", action="store_true", help="the channels_last format, CUDA only")
    a = ap.parse_args()
    cfg = build_config({
        "model": {"name": a.model, "num_classes": 10},
        "data": {"name": "synthetic", "image_size": a.image_size, "batch_size": a.batch, "workers": a.workers,
                 "synthetic_size": a.batch * (a.steps + a.warmup) * 4},
        "optim": {"name": "sgd", "lr": 0.01, "momentum": 0.9, "weight_decay": 1e-4},
        "train": {"steps": a.steps + a.warmup, "warmup_log_steps": a.warmup, "log_every": 10, "device": a.device,
                  "precision": a.precision, "channels_last": a.channels_last},
    })
    bare, ours = [], []
    for _ in range(a.repeats):
        bare.append(bare_loop(cfg, a.steps, a.warmup))
        ours.append(scaletrain_run(cfg))
    print(json.dumps({
        "benchmark": "overhead", "model": a.model, "image_size": a.image_size, "batch": a.batch,
        "steps": a.steps, "repeats": a.repeats, "loader_workers": a.workers,
        "bare_images_per_sec": bare, "scaletrain_images_per_sec": ours,
        "ratio": statistics.median(ours) / statistics.median(bare),
        **({"precision": a.precision} if a.precision != "fp32" else {}),
        **({"channels_last": True} if a.channels_last else {}),
        **run_info(pick_device(cfg)),
    }, indent=2))


if __name__ == "__main__":
    main()
