"""Throughput of `scaletrain train` against bare PyTorch loops, like for like.

Three loops train the same model, batch, synthetic data and optimizer in this process:

- scaletrain: `scaletrain train`'s loop (loop.train), one process, no DDP;
- bare_loader: the loop a user would write by hand, fed by the same loader scaletrain builds (its
  worker processes, pinned memory, the device's part of the input), with no metrics, checkpoints
  or strategy;
- bare_resident: the same bare loop reusing one batch already on the device: what the model alone
  runs at, with no input at all.

scaletrain against bare_loader is the overhead of scaletrain itself (overhead_ratio, goal >= 0.97);
bare_loader against bare_resident is the input's cost (input_ratio). Each loop excludes its warm-up
steps, closes a window every --window steps with a device sync (scaletrain's loop syncs at its log
points, every --window steps too) and reports each window's images/s; window_spread is the largest
distance of a window's rate from the median window's, as a fraction of it (goal within 0.10): a
host-side stall shows there before it shows in a mean. Runs alternate (bare_resident, bare_loader,
scaletrain, ...) so drifts in machine load hit all three; each figure is a ratio of medians.

--profile-steps N adds one more run of scaletrain and of bare_loader under torch.profiler, N steps
after the warm-up: the host-side ops with the most self CPU time, and the calls where the host
waits for the device (cudaStreamSynchronize, cudaDeviceSynchronize, cudaEventSynchronize, item()),
per step. Those runs are not timed: the profiler's own cost would enter the figures.

On a GPU all three use the same precision and memory format (--precision bf16: autocast in the
forward pass; --channels-last) and cuDNN's autotuner, as scaletrain does outside
train.deterministic. Prints one JSON object.

    python benchmarks/overhead.py [--model resnet20 --image-size 32 --batch 64 --steps 60 --repeats 3]
                                  [--workers 4] [--profile-steps 20]
                                  [--device cuda --precision bf16 --channels-last]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from scaletrain.config import build_config
from scaletrain.data import Prepare, build_datasets
from scaletrain.data.loader import collate, train_loader
from scaletrain.job import pick_device
from scaletrain.loop import train
from scaletrain.metrics import run_info, sync
from scaletrain.models import build_model

LOOPS = ("bare_resident", "bare_loader", "scaletrain")
GOALS = {"overhead_ratio": 0.97, "window_spread": 0.10}
# Where the host waits for the device: each blocks the Python thread until queued GPU work is done
# (item() through aten::_local_scalar_dense, a device-to-host copy and a stream sync).
HOST_WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "aten::item",
              "aten::_local_scalar_dense")
TOP_OPS = 12


def spread(rates: list[float]) -> dict:
    """Windows' images/s against their median: the slowest and fastest as fractions of it, and the
    largest distance from it (the goal's figure)."""
    if not rates:
        return {"windows": 0, "median": None, "slowest_fraction": None, "fastest_fraction": None, "spread": None}
    med = statistics.median(rates)
    return {"windows": len(rates), "median": med, "slowest_fraction": min(rates) / med,
            "fastest_fraction": max(rates) / med, "spread": max(abs(r - med) for r in rates) / med}


def host_waits(averages, steps: int) -> dict:
    """A profile's summary: the host-side ops by self CPU time and the calls that wait for the device,
    per profiled step. `averages` is torch.profiler's key_averages() (self_cpu_time_total in us)."""
    rows = [a for a in averages if not a.key.startswith("ProfilerStep")]
    top = sorted(rows, key=lambda a: a.self_cpu_time_total, reverse=True)[:TOP_OPS]
    per = lambda us: round(us / 1e3 / steps, 4)  # noqa: E731 - ms a step
    waits = {a.key: {"calls_per_step": a.count / steps, "self_cpu_ms_per_step": per(a.self_cpu_time_total)}
             for a in rows if a.key in HOST_WAITS}
    return {"profiled_steps": steps,
            "top_self_cpu": [{"op": a.key, "calls_per_step": a.count / steps,
                              "self_cpu_ms_per_step": per(a.self_cpu_time_total)} for a in top],
            "host_waits": waits,
            "host_wait_ms_per_step": round(sum(w["self_cpu_ms_per_step"] for w in waits.values()), 4)}


def same_loader(cfg, train_set, device, channels_last: bool):
    """The batches scaletrain's Job gives its loop (job.batches): the same loader, the same device part."""
    loader = train_loader(train_set, cfg, 0, None, world=1, rank=0, pin=device.type == "cuda")[0]
    prepare = Prepare(cfg.data.augment, train_set.stats, device, channels_last)
    return (prepare(batch) for batch in loader)


def bare_loop(cfg, steps: int, warmup: int, window: int, source: str) -> tuple[float, list[float]]:
    """The loop a user would write by hand; `source` "resident" reuses one batch on the device, "loader"
    takes scaletrain's. Returns its images/s and each window's."""
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
    if source == "resident":
        one = Prepare([], train_set.stats, device, fmt is torch.channels_last)(
            collate([(*train_set[i], None) for i in range(b)]))
        batches = iter(lambda: one, None)
    else:
        batches = same_loader(cfg, train_set, device, fmt is torch.channels_last)
    rates, t0 = [], 0.0
    for i in range(warmup + steps + 1):
        if i >= warmup and (i - warmup) % window == 0:
            sync(device)  # host-device sync: a window closes on finished work, as at scaletrain's log points
            now = time.perf_counter()
            if i > warmup:
                rates.append(window * b / (now - t0))
            t0 = now
        if i == warmup + steps:
            break
        xs, ys = next(batches)
        with autocast:
            loss = torch.nn.functional.cross_entropy(model(xs).float(), ys)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    del batches  # stops the loader's worker processes
    return steps * b / sum(window * b / r for r in rates), rates


def scaletrain_run(cfg) -> tuple[float, list[float]]:
    """`scaletrain train`'s loop: its images/s and each log window's (metrics.jsonl)."""
    with tempfile.TemporaryDirectory() as d:
        summary = train(cfg, d, progress=False)
        rows = [json.loads(line) for line in (Path(d) / "metrics.jsonl").read_text().splitlines()]
    return summary["images_per_sec"], [r["images_per_sec"] for r in rows if r.get("images_per_sec")]


def profiled(run, warmup: int, steps: int) -> dict:
    """host_waits of `run()` over `steps` optimizer steps after `warmup`: the profiler's steps are
    counted by a hook on every optimizer's step, so scaletrain's loop is profiled as it runs."""
    from torch.optim.optimizer import register_optimizer_step_post_hook
    from torch.profiler import ProfilerActivity, profile, schedule  # heavy: only a profiled run needs it

    if warmup < 1:
        raise SystemExit("overhead: --profile-steps needs --warmup 1 or more (the profiler's own warm-up step)")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities, schedule=schedule(wait=max(warmup - 1, 0), warmup=1, active=steps,
                                                          repeat=1)) as prof:
        hook = register_optimizer_step_post_hook(lambda *_: prof.step())
        try:
            run()
        finally:
            hook.remove()
    return host_waits(prof.key_averages(), steps)


def figures(times: dict[str, list[float]], windows: dict[str, list[list[float]]]) -> dict:
    """The like-for-like ratios and each loop's window spread (its worst run)."""
    med = {k: statistics.median(v) for k, v in times.items()}
    worst = {k: max((spread(w) for w in runs), key=lambda s: s["spread"] or 0.0) for k, runs in windows.items()}
    return {"overhead_ratio": med["scaletrain"] / med["bare_loader"],
            "input_ratio": med["bare_loader"] / med["bare_resident"],
            "window_spread": worst,
            "goals": GOALS,
            "goals_met": {"overhead_ratio": med["scaletrain"] / med["bare_loader"] >= GOALS["overhead_ratio"],
                          "window_spread": (worst["scaletrain"]["spread"] or 0.0) <= GOALS["window_spread"]}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet20")
    ap.add_argument("--image-size", type=int, default=32)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--window", type=int, default=10, help="steps a window (scaletrain's train.log_every)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workers", type=int, default=0, help="loader processes of scaletrain and bare_loader")
    ap.add_argument("--profile-steps", type=int, default=0, help="profile this many steps of each loader-fed loop")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16"), help="bf16: autocast, CUDA only")
    ap.add_argument("--channels-last", action="store_true", help="the channels_last format, CUDA only")
    a = ap.parse_args()
    if a.steps % a.window:
        ap.error(f"--steps {a.steps} is not a whole number of --window {a.window} steps")

    def config(steps: int):
        return build_config({
            "model": {"name": a.model, "num_classes": 10},
            "data": {"name": "synthetic", "image_size": a.image_size, "batch_size": a.batch, "workers": a.workers,
                     "augment": [], "synthetic_size": a.batch * (steps + a.warmup) * 4},
            "optim": {"name": "sgd", "lr": 0.01, "momentum": 0.9, "weight_decay": 1e-4},
            "train": {"steps": steps + a.warmup, "warmup_log_steps": a.warmup, "log_every": a.window,
                      "eval_every": 0, "checkpoint_every": 0, "device": a.device, "precision": a.precision,
                      "channels_last": a.channels_last},
        })

    cfg = config(a.steps)
    times = {k: [] for k in LOOPS}
    windows = {k: [] for k in LOOPS}
    for _ in range(a.repeats):
        for loop in LOOPS:
            rate, wins = scaletrain_run(cfg) if loop == "scaletrain" else \
                bare_loop(cfg, a.steps, a.warmup, a.window, loop.removeprefix("bare_"))
            times[loop].append(rate)
            windows[loop].append(wins)
    out = {"benchmark": "overhead", "model": a.model, "image_size": a.image_size, "batch": a.batch,
           "steps": a.steps, "warmup": a.warmup, "window": a.window, "repeats": a.repeats, "loader_workers": a.workers,
           **{f"{k}_images_per_sec": v for k, v in times.items()},
           **figures(times, windows),
           "windows_images_per_sec": windows}
    if a.profile_steps:
        short = config(a.profile_steps)
        out["host_profile"] = {
            "scaletrain": profiled(lambda: scaletrain_run(short), a.warmup, a.profile_steps),
            "bare_loader": profiled(lambda: bare_loop(short, a.profile_steps, a.warmup, a.profile_steps, "loader"),
                                    a.warmup, a.profile_steps)}
    if a.precision != "fp32":
        out["precision"] = a.precision
    if a.channels_last:
        out["channels_last"] = True
    print(json.dumps({**out, **run_info(pick_device(cfg))}, indent=1))


if __name__ == "__main__":
    main()
