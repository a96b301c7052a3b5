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
4. `Slowed`: the straggler's compute (strategy.slow_node), for the study of stragglers.

Job (job.py) keeps the loop's calls and the job's lifetime; the tracker, which reports the job, is
built between 1 and 2 from what `assemble` returns.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .comm.groups import Context
from .compute import around
from .config import Config, dump_toml
from .ema import Ema
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
        load_replica_buffers(net, saved[ctx.me.stage] if saved and pipeline else saved, ctx.plan.replica_of(ctx.me))
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


class Slowed:
    """A replica's compute timer on the straggler node (strategy.slow_node = the node, slow_delay_s
    = the seconds): each update's compute starts with that sleep, inside the timed compute, as a
    slower device's would take longer. One sleep an update, at its first micro-batch's start, what
    the performance model assumes (perfmodel/simulate.py). Any loop, real or emulated compute,
    pipeline stages, takes it: job.batches() starts the timer before each batch it gives."""

    def __init__(self, timer, delay: float, accum: int) -> None:
        self.timer, self.delay, self.accum, self.started = timer, delay, accum, 0

    def start(self) -> None:
        self.timer.start()
        if self.started % self.accum == 0:
            time.sleep(self.delay)
        self.started += 1

    def __getattr__(self, name: str):
        return getattr(self.timer, name)  # stop, seconds: the timer's own


def slowed(timer, cfg: Config, node: int):
    """The compute timer of a replica on `node`: Slowed on strategy.slow_node, the timer itself elsewhere."""
    s = cfg.strategy
    return Slowed(timer, s.slow_delay_s, cfg.train.grad_accum_steps) if node == s.slow_node and s.slow_delay_s \
        else timer
