"""Run one training job: the one function `scaletrain train`, bench and calibrate call.

Where the job runs follows from the config and from where this process is:
- a single-process config trains here;
- under torchrun or srun this process is one of the job's: it does its part
  and exits;
- inside a Slurm allocation, one srun step starts every process of the plan;
- otherwise the local launcher starts them all on this machine.
The launchers' processes are supervised by launch/supervise.py: a job that
fails is started again from its newest checkpoint.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from .device import facts
from .errors import LaunchError
from .launch import entry, supervise
from .proc import early, env as launch_env
from .loop import train
from .models import check_network
from .optim import is_class_path, probe
from .rundir import prepare_run_dir

log = logging.getLogger("scaletrain")

# The share of a run's timed training that worker 0 may spend waiting for its next batch before
# the run's command says so. The warning exists to say that the input, not the devices, sets the
# job's pace, and its advice (more loader processes, shards, fewer augmentations) costs the user a
# change and a rerun. At a quarter, input holds the job to three quarters of what its devices do:
# faster input would make it a third faster. Below that the figure does not tell a slow input from
# its fixed costs: every batch is handed over (a queue, a copy to the device, on a CPU device the
# crop and normalisation in the training process), and where the loaders share the CPUs with
# training, that hand-over alone can take a tenth of a small model's step from a loader that keeps up.
SLOW_INPUT = 0.25


def warn_slow_input(summary: dict[str, Any], cfg) -> None:
    """Warn once, after a run, when worker 0 waited for data over SLOW_INPUT of its timed training
    (summary.json's data_wait_fraction: the whole run past its warm-up, not a few log windows,
    which a burst of other work on the machine or a loader's start tips over any bound). The run's
    command and the API's train call it for the user who asked for the run; jobs that other
    commands run to measure something (bench's cells, whose table has the figure, calibrate's jobs)
    do not."""
    wait = summary.get("data_wait_fraction")
    if wait is None or wait < SLOW_INPUT:
        return
    log.warning("worker 0 waited for data %.0f%% of the run's timed training (data_wait_fraction in summary.json): "
                "its data.workers = %d loader processes decode and augment slower than the model trains; raise "
                "data.workers where cores are free, pack the images into shards (scaletrain pack), or lighten "
                "data.augment", 100 * wait, cfg.data.workers)


def run_training(cfg, run_dir: Path, resume: bool = False, progress: bool = True,
                 plan_node: int | None = None) -> dict[str, Any]:
    """Train cfg into run_dir; the run's summary (summary.json). Under torchrun or srun, where this
    process is one of the job's: the summary on the chief, {} on the other workers, and a process
    that ends otherwise (a parameter server, a failure, a stop) exits with its status (entry.process).

    Raises PlanError, LaunchError or ConfigError (a job that cannot start as asked: ModelNameError
    for a network by import path that cannot be built or does not fit the data), one of
    errors.USER_ERRORS (a job that failed; str() is one line), Stopped (a stop
    signal: every process checkpointed at one step and stopped) and
    KeyboardInterrupt when the user stopped it (every process is stopped by then).
    plan_node: under torchrun, this agent's node index in the plan.
    """
    # An impossible cluster shape fails here, before any work; a local job also on this host's GPUs.
    launch_env.plan_for(cfg, None if launch_env.in_slurm_allocation() else facts())
    member = launch_env.in_torchrun() or launch_env.in_slurm_step()
    if cfg.cluster.network == "netns" and (member or launch_env.in_slurm_allocation()):
        raise LaunchError("cluster.network = netns: the cluster twin emulates nodes on one machine (the local "
                          "launcher); under torchrun or Slurm the nodes have a network of their own: set it to loopback")
    if not (cfg.distributed and member):  # a process of a job meets its peers, and they stop together
        early.check(run_dir)  # a stop signal during start-up: nothing begun, nothing to checkpoint
    if not member and is_class_path(cfg.optim.name):
        probe(cfg.optim)  # an optimizer by import path: built and stepped once on CPU, before any process starts
    if not cfg.distributed:
        check_network(cfg)  # a network by import path: built once and its output checked (models/factory.py)
        return train(cfg, run_dir, resume=resume, progress=progress)
    resume = prepare_run_dir(run_dir, resume, cfg)
    if member:  # this process is one of the job's
        return entry.process(cfg, run_dir, resume, progress, node=plan_node)
    return supervise.run(cfg, run_dir, resume, progress)
