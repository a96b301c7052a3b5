"""`scaletrain train` with allreduce against a bare DistributedDataParallel loop.

The same model, batch per replica, synthetic data and SGD, on R replicas of
this host (processes, gloo, one thread each): R = 2 and 4 by default. The
bare loop is what a user would write by hand: DDP around the model, one
batch already in memory, no loader, no checkpoints, no metrics. Runs
alternate (bare, scaletrain, bare, ...) so the host's slow and fast spells
hit both; per R the figure is the ratio of the medians of the job's images/s
(all replicas' images over the measured steps' wall time). Prints one JSON
object.

scaletrain's workers keep the host memory a step frees (compute.keep_freed_memory);
a bare loop as users write it does not. --bare-keeps-memory gives the bare
loop the same allocator settings, to see how much of the ratio is that.

--device cuda: one GPU per replica (R at most the GPUs visible), NCCL, the bare
loop's model, batch and DDP on the replica's GPU, with scaletrain's precision and
memory format (--precision bf16, --channels-last) and cuDNN's autotuner; every
replica synchronises its GPU before the barriers that start and stop the clock.
scaletrain's loader processes (--workers) then feed it as they would in training.

    python benchmarks/ddp_parity.py [--replicas 2 4] [--model resnet20 --image-size 32 --batch 32 --steps 40]
                                    [--bare-keeps-memory] [--device cuda --precision bf16 --channels-last --workers 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from scaletrain.compute import keep_freed_memory
from scaletrain.config import build_config
from scaletrain.data import Prepare, build_datasets
from scaletrain.data.loader import collate
from scaletrain.launch.local import free_port
from scaletrain.metrics import run_info
from scaletrain.models import build_model
from scaletrain.run import run_training


def bare_replica(rank: int, world: int, port: int, cfg, steps: int, warmup: int, out, keep: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if keep:
        keep_freed_memory()
    cuda = cfg.train.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)  # before NCCL: this replica's GPU, never GPU 0 for all
        torch.backends.cudnn.benchmark = True  # as scaletrain's non-deterministic runs
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    fmt = torch.channels_last if cfg.train.channels_last and cuda else torch.contiguous_format
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cfg.train.precision == "bf16" and cuda \
        else nullcontext()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(build_model(cfg.model).to(device, memory_format=fmt),
                                                      device_ids=[rank] if cuda else None)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.optim.lr, momentum=cfg.optim.momentum,
                          weight_decay=cfg.optim.weight_decay)
    train_set, _, _ = build_datasets(cfg)
    b = cfg.data.batch_size
    xs, ys = Prepare([], train_set.stats, device, fmt is torch.channels_last)(
        collate([(*train_set[rank * b + i], None) for i in range(b)]))
    for i in range(warmup + steps):
        if i == warmup:
            settle(cuda)
            t0 = time.perf_counter()
        with autocast:
            loss = torch.nn.functional.cross_entropy(model(xs).float(), ys)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    settle(cuda)
    if rank == 0:
        out.put(world * steps * b / (time.perf_counter() - t0))
    dist.destroy_process_group()


def settle(cuda: bool) -> None:
    """Every replica's queued work done, then all together: where the clock may be read."""
    if cuda:
        torch.cuda.synchronize()  # host-device sync: this replica's kernels, NCCL's included
    dist.barrier()  # collective; under NCCL it also blocks the host until it completes


def bare(cfg, world: int, steps: int, warmup: int, keep: bool = False) -> float:
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    mp.start_processes(bare_replica, args=(world, free_port("127.0.0.1"), cfg, steps, warmup, out, keep),
                       nprocs=world, start_method="spawn")
    return out.get()


def ours(cfg, world: int) -> float:
    job = cfg.replace(**{"cluster.nodes": 1, "cluster.gpus_per_node": world, "strategy.name": "allreduce"})
    with tempfile.TemporaryDirectory() as d:
        return run_training(job, Path(d) / "run", progress=False)["images_per_sec"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", nargs="+", type=int, default=[2, 4])
    ap.add_argument("--model", default="resnet20")
    ap.add_argument("--image-size", type=int, default=32)
    ap.add_argument("--batch", type=int, default=32, help="images per replica per step")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bare-keeps-memory", action="store_true",
                    help="the bare loop keeps freed memory as scaletrain's workers do")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cuda: one GPU per replica, NCCL")
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16"), help="bf16: autocast, CUDA only")
    ap.add_argument("--channels-last", action="store_true", help="the channels_last format, CUDA only")
    ap.add_argument("--workers", type=int, default=0, help="scaletrain loader processes per replica")
    a = ap.parse_args()
    cuda = a.device == "cuda"
    if cuda and torch.cuda.device_count() < max(a.replicas):
        n = max(a.replicas)
        raise SystemExit(f"ddp_parity: --device cuda with {n} replica{'s' * (n > 1)} needs {n} GPU{'s' * (n > 1)}, "
                         f"one each; torch {torch.__version__} sees {torch.cuda.device_count()}")
    rows = []
    for world in a.replicas:
        cfg = build_config({
            "model": {"name": a.model, "num_classes": 10},
            "data": {"name": "synthetic", "image_size": a.image_size, "batch_size": a.batch, "workers": a.workers,
                     "augment": [], "synthetic_size": a.batch * world * 4},
            "optim": {"name": "sgd", "lr": 0.01, "momentum": 0.9, "weight_decay": 1e-4},
            "train": {"steps": a.steps + a.warmup, "warmup_log_steps": a.warmup, "log_every": 10, "threads": 1,
                      "eval_every": 0, "checkpoint_every": 0, "device": a.device, "precision": a.precision,
                      "channels_last": a.channels_last},
        })
        b, s = [], []
        for _ in range(a.repeats):
            b.append(bare(cfg, world, a.steps, a.warmup, a.bare_keeps_memory))
            s.append(ours(cfg, world))
        rows.append({"replicas": world, "bare_ddp_images_per_sec": b, "scaletrain_images_per_sec": s,
                     "ratio": statistics.median(s) / statistics.median(b)})
    print(json.dumps({"benchmark": "ddp_parity", "model": a.model, "image_size": a.image_size,
                      "batch_per_replica": a.batch, "steps": a.steps, "repeats": a.repeats,
                      "backend": "nccl" if cuda else "gloo", "bare_keeps_memory": a.bare_keeps_memory,
                      **({"precision": a.precision} if a.precision != "fp32" else {}),
                      **({"channels_last": True} if a.channels_last else {}),
                      **({"loader_workers": a.workers} if a.workers else {}),
                      "rows": rows, "min_ratio": min(r["ratio"] for r in rows),
                      **run_info(torch.device("cuda", 0) if cuda else torch.device("cpu"))},
                     indent=2))


if __name__ == "__main__":
    main()
