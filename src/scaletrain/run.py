"""Run one training job: the one function `scaletrain train`, bench and calibrate call.

Where the job runs follows from the config and from where this process is:
- a single-process config trains here;
- under torchrun or srun this process is one of the job's: it does its part
  and exits;
- inside a Slurm allocation, one srun step starts every process of the plan;
- otherwise the local launcher starts them all on this machine.
A job that fails is started again from its newest complete checkpoint, up
to cluster.max_restarts times; without the failed worker node when
cluster.min_nodes allows (allreduce: train.steps is rescaled so that the
job's target stays the same images). torch is imported only once a job is
about to run.
"""

from __future__ import annotations

import json
import math
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

from .errors import EXIT_STOPPED, LaunchError, RunError, Stopped
from .launch import env as launch_env


def run_dir_for(recipe: str, given: str | None, cfg) -> Path:
    """--run-dir, or runs/RECIPE-TIME. Every process of a torchrun/srun job must be told
    the same one: each would stamp its own time."""
    if given:
        return Path(given)
    if cfg.distributed and (launch_env.in_torchrun() or launch_env.in_slurm_step()):
        raise LaunchError("under torchrun or srun every process must be given the same --run-dir")
    return Path(f"runs/{Path(recipe).stem}-{time.strftime('%Y%m%d-%H%M%S')}")


def run_training(cfg, run_dir: Path, resume: bool = False, progress: bool = True,
                 plan_node: int | None = None) -> dict[str, Any]:
    """Train cfg into run_dir; the run's summary (summary.json).

    Raises PlanError or LaunchError (a job that cannot start as asked), one of
    errors.USER_ERRORS (a job that failed; str() is one line), Stopped (a stop
    signal: every process checkpointed at one step and stopped) and
    KeyboardInterrupt when the user stopped it (every process is stopped by then).
    plan_node: under torchrun, this agent's node index in the plan.
    """
    from .device import facts
    from .rundir import prepare_run_dir
    from .train import train

    # An impossible cluster shape fails here, before any work; a local job also on this host's GPUs.
    launch_env.plan_for(cfg, None if launch_env.in_slurm_allocation() else facts())
    if not cfg.distributed:
        return train(cfg, run_dir, resume=resume, progress=progress)
    resume = prepare_run_dir(run_dir, resume, cfg)
    if launch_env.in_torchrun() or launch_env.in_slurm_step():
        from .launch.entry import exit_now, run

        exit_now(run(cfg, run_dir, resume, progress, node=plan_node))
    from .data import check_files

    check_files(cfg, run_dir)  # once for the job, before its processes start; its chief finds the record
    if launch_env.in_slurm_allocation():
        from .launch.slurm import run_job as start
    else:
        from .launch.local import launch as start
    restarts, failure = 0, run_dir / "logs" / "failure.json"
    while True:
        failure.unlink(missing_ok=True)
        rc = start(cfg, run_dir, resume=resume, progress=progress)
        if rc == 0 and (run_dir / "summary.json").exists():
            return json.loads((run_dir / "summary.json").read_text())
        if rc == 0:
            raise RunError(f"every process ended, but none wrote {run_dir / 'summary.json'}; logs in {run_dir / 'logs'}")
        if rc in (EXIT_STOPPED, 130):  # the launcher saw every process stop on request
            raise (KeyboardInterrupt if rc == 130 else Stopped)(_where(run_dir))
        culprit = json.loads(failure.read_text()) if failure.exists() else {"what": f"exit status {rc}"}
        if restarts >= cfg.cluster.max_restarts:
            raise RunError(f"the job failed: {culprit['what']}" + (f" (after {restarts} restarts)" if restarts else "")
                           + f"; logs in {run_dir / 'logs'}")
        restarts += 1
        resume = bool(_checkpoints(run_dir))
        smaller, without = _without(cfg, culprit)
        if smaller is not None:
            cfg = smaller
            if launch_env.in_slurm_allocation():
                start = partial(start, exclude=(culprit.get("host"),))
        print(f"scaletrain: {culprit['what']}; restart {restarts} of {cfg.cluster.max_restarts}{without}: "
              f"{_where(run_dir, lost=True)}", file=sys.stderr, flush=True)


def _without(cfg, culprit: dict):
    """The config of a restart that leaves the failed worker node out, when cluster.min_nodes
    allows it, and the words that say so; (None, "") otherwise. The target stays the same
    images: train.steps counts global batches, which get smaller."""
    c = cfg.cluster
    node = culprit.get("node")
    if node is None or culprit.get("role") != "worker" or not c.min_nodes or c.nodes - 1 < c.min_nodes:
        return None, ""
    sets = {"cluster.nodes": c.nodes - 1}
    if cfg.train.steps:
        sets["train.steps"] = math.ceil(cfg.train.steps * c.nodes / (c.nodes - 1))
    return cfg.replace(**sets), (f" without node {node + 1} ({c.nodes - 1} worker nodes, "
                                 f"cluster.min_nodes = {c.min_nodes})")


def _checkpoints(run_dir: Path) -> list[int]:
    from .checkpoint import list_complete

    return [step for step, _ in list_complete(run_dir / "checkpoints")]


def _where(run_dir: Path, lost: bool = False) -> str:
    """Where a stopped or failed job stands: its newest checkpoint, and the steps done since."""
    steps = _checkpoints(run_dir)
    last = 0
    try:
        rows = (run_dir / "metrics.jsonl").read_text().splitlines()
        last = max((json.loads(r).get("step", 0) for r in rows[-50:] if r.strip()), default=0)
    except (OSError, ValueError):
        pass
    if not steps:
        return f"no checkpoint yet: starting again from step 0 ({last} steps lost)" if lost else \
            "stopped before its first checkpoint"
    if lost:
        return f"resuming from the checkpoint of step {steps[-1]} ({max(last - steps[-1], 0)} logged steps lost)"
    return f"stopped at step {steps[-1]}; its checkpoint is complete; the same command continues the run"
