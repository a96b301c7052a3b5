"""Run one training job: the one function `scaletrain train`, bench and calibrate call.

Where the job runs follows from the config and from where this process is:
- a single-process config trains here;
- under torchrun or srun this process is one of the job's: it does its part
  and exits;
- inside a Slurm allocation, one srun step starts every process of the plan;
- otherwise the local launcher starts them all on this machine.
torch is imported only once a job is about to run.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from .errors import LaunchError, RunError
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
    errors.USER_ERRORS (a job that failed; str() is one line), and
    KeyboardInterrupt when the user stopped it (every process is stopped by then).
    plan_node: under torchrun, this agent's node index in the plan.
    """
    from .train import prepare_run_dir, train

    launch_env.plan_for(cfg)  # an impossible cluster shape fails here, before any work
    if not cfg.distributed:
        return train(cfg, run_dir, resume=resume, progress=progress)
    resume = prepare_run_dir(run_dir, resume, cfg)
    if launch_env.in_torchrun() or launch_env.in_slurm_step():
        from .launch.entry import exit_now, run

        exit_now(run(cfg, run_dir, resume, progress, node=plan_node))
    if launch_env.in_slurm_allocation():
        from .launch.slurm import run_job

        rc = run_job(cfg, run_dir, resume, progress)
    else:
        from .launch.local import launch

        rc = launch(cfg, run_dir, resume=resume, progress=progress)
    if rc == 130:  # the launcher caught Ctrl-C and stopped every process
        raise KeyboardInterrupt
    if rc:
        raise RunError(f"the job failed (exit status {rc}); logs in {run_dir / 'logs'}")
    return json.loads((run_dir / "summary.json").read_text())
