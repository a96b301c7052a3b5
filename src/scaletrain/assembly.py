"""What job.wrap() builds around a model, in the order it must be built.

1. `assemble`: the parts that hold the model's state. The pipeline stage (parallel.stages > 1; a
   resumed run keeps its checkpoint's split), the network on this process's device (channels-last
   on CUDA), the optimizer, the checkpoint's weights and optimizer state, the run directory (only
   now: a config or data refused before it leaves none behind), the strategy with its own state
   restored, and the average of the weights (train.ema_decay), built after the restore because a
   parameter server strategy's values are its shards'.
2. `loop_module`: the module the loop calls. The strategy's (a DistributedDataParallel under
   allreduce, whose backward averages the gradients), the pipeline's schedule around it, or, around
   both, torch.compile and autocast (compute.around).
3. `noise_split`: how one replica measures the gradient noise scale when no group measures it.
4. `compute_timer`: the timer of a replica's compute, the straggler's slowed (strategy.slow_node),
   for the study of stragglers.

Job (job.py) keeps the loop's calls and the job's lifetime; the tracker, which reports the job, is
built between 1 and 2 from what `assemble` returns.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from .comm.groups import Context
from .compute import around
from .config import Config, dump_toml
from .ema import Ema
from .metrics import DeviceTimer, sync
from .noise import NoiseScale
from .optim import build_optimizer
from .pipeline import Pipeline
from .replicas import load_replica_buffers
from .resume import resume_from
from .rundir import make as make_run_dir
from .schedule import Schedule
from .strategies.base import Strategy
from .strategies.build import build_strategy


@dataclass
class Assembled:
    """The model's parts, as assemble() built and restored them."""

    model: torch.nn.Module  # the user's network (with stages: every layer, the other stages' off this device)
    net: torch.nn.Module  # the layers this process trains, on its device: the network, or its stage
    optimizer: torch.optim.Optimizer
    strategy: Strategy
    pipeline: Pipeline | None
    ema: Ema | None
    resumed: Any  # resume.Resumed, its state handed to the parts above; None when the job starts afresh
    channels_last: bool


def assemble(cfg: Config, ctx: Context, device: torch.device, run_dir: Path, classes: list[str],
             sched: Schedule, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
             found: tuple | None) -> Assembled:
    """Build and restore the parts (the module doc, 1). found: the checkpoint to resume from
    (resume.newest_checkpoint), or None. optimizer None: the recipe's [optim]."""
    pipeline = Pipeline(cfg, ctx, model, device, found and found[0].get("pipeline_split")) \
        if cfg.parallel.stages > 1 else None
    net = pipeline.module if pipeline else model.to(device)  # a stage's layers only go to its device
    model = model if pipeline else net
    channels_last = cfg.train.channels_last and device.type == "cuda"
    if channels_last:
        net = model = model.to(memory_format=torch.channels_last)
    opt = optimizer or build_optimizer(cfg.optim, net.parameters())
    resumed = resume_from(found, model, opt, sched.step_images, pipeline and pipeline.local_optimizer) \
        if found else None
    if ctx.is_chief:
        make_run_dir(run_dir)
        (run_dir / "config.toml").write_text(dump_toml(cfg))
        (run_dir / "classes.txt").write_text("\n".join(classes) + "\n")
    strategy = build_strategy(cfg, ctx, net, opt, sched)
    if pipeline:
        strategy.set_stages([[q.numel() for q in part.parameters()] for part in pipeline.parts])
    if resumed is not None:
        strategy.restore(resumed.state)
        saved = resumed.state.get("replica_buffers")
        load_replica_buffers(net, saved[ctx.me.stage] if saved and pipeline else saved, ctx.plan.replica_of(ctx.me),
                             strategy.replica_state())
    ema = Ema(cfg.train.ema_decay, model, net) if cfg.train.ema_decay else None  # a stage averages its own layers
    if resumed is not None:
        if ema is not None:
            ema.load_state_dict(resumed.state.get("ema"))
        resumed.state = None  # the model, optimizer and strategy hold it now
    return Assembled(model, net, opt, strategy, pipeline, ema, resumed, channels_last)


def loop_module(cfg: Config, parts: Assembled, device: torch.device) -> tuple[Any, bool, list[str]]:
    """(module the loop calls, whether its backward averages the replicas' gradients, the keys that
    apply only through calls of it: compute.around). Emulated compute runs no backward: its strategy
    averages in its step, not in a DDP's backward. With stages, the pipeline's schedule is the module
    (job.forward_backward calls it); it autocasts itself and compiles nothing (config_checks)."""
    strategy = parts.strategy
    module = strategy.model if cfg.train.emulate_compute_s else strategy.wrap()
    if parts.pipeline:
        return parts.pipeline.build(module), True, []
    averaging = module is not strategy.model
    module, calls_only = around(module, parts.optimizer, cfg.train.precision, cfg.train.compile, device)
    return module, averaging, calls_only


def noise_split(cfg: Config, strategy: Strategy, device: torch.device, not_applied: dict[str, str]) -> int:
    """Every how many updates this replica measures the noise scale from half its batch (job.loss;
    noise.half_batch), setting strategy.noise for it: train.noise_every where no replicas' group
    measures it at every step and a backward of this batch's gradients exists; else 0, with the reason
    in not_applied."""
    every, b = cfg.train.noise_every, cfg.data.batch_size
    if not every:
        return 0
    if strategy.noise is None and b >= 2 and not cfg.train.emulate_compute_s and not cfg.strategy.emulate_workers:
        strategy.noise = NoiseScale(b // 2, b * cfg.train.grad_accum_steps, device)  # half a micro-batch, the update
        return every
    not_applied["train.noise_every"] = (
        "the replicas' group measures the noise scale at every step" if strategy.noise is not None
        else "no backward of this batch's gradients to measure (emulated compute or workers, or 1 image)")
    return 0


class Slowed(DeviceTimer):
    """A replica's compute timer on the straggler node (strategy.slow_node = the node, slow_delay_s
    = the seconds): each update's compute starts with that sleep, inside the timed compute, as a
    slower device's would take longer. One delay an update, as the performance model adds
    (perfmodel/simulate.py), at the update's first micro-batch (`first()`). On a GPU the queued work
    of the update before ends first (a host-device sync, as compute.Emulated's): a sleep beside it
    would be hidden by it, and the timer's start event would fire only after it. Any loop takes it,
    real or emulated compute, pipeline stages: job.batches() starts the timer before each batch."""

    def __init__(self, device: torch.device, delay: float, first: Callable[[], bool]) -> None:
        super().__init__(device)
        self.device, self.delay, self.first = device, delay, first

    def start(self) -> None:
        if not self.first():
            return super().start()
        sync(self.device)
        super().start()
        time.sleep(self.delay)


def compute_timer(cfg: Config, node: int, device: torch.device, first: Callable[[], bool]) -> DeviceTimer:
    """The timer of a replica's compute on `node`: Slowed on strategy.slow_node, a DeviceTimer elsewhere.
    first(): whether the micro-batch about to start is its update's first."""
    s = cfg.strategy
    if node == s.slow_node and s.slow_delay_s:
        return Slowed(device, s.slow_delay_s, first)
    return DeviceTimer(device)
