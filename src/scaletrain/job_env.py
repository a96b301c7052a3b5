"""What Job.from_env reads of the process it runs in: the config, run directory and plan node of a
process about to join its job, and a script's default run directory."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from .config import Config, load_config
from .errors import LaunchError
from .proc import env as launch_env
from .rundir import prepare_run_dir


def joining(cfg: Config, launched: str | None, run_dir, resume: bool) -> tuple[Config, Path, bool, int | None]:
    """(config, run directory, resume, plan node) of a process about to join its job: as its launcher
    resolved them (launch/supervise.py: RUN_DIR/config.toml and the environment), or, under torchrun
    or srun, as given, the run directory checked as `scaletrain train` checks it there."""
    if not (launched or run_dir):
        raise LaunchError("under torchrun or srun every process must be given the same run_dir")
    run_dir = Path(launched or run_dir)
    if launched:  # the job's config as its launcher resolved it: the port, a restart's node count
        cfg, resume = load_config(run_dir / "config.toml"), os.environ.get(launch_env.RESUME_ENV) == "1"
    else:
        resume = prepare_run_dir(run_dir, resume, cfg)
    node = os.environ.get(launch_env.PLAN_NODE_ENV, "")
    if node and not node.isdigit():
        raise LaunchError(f"{launch_env.PLAN_NODE_ENV} = {node!r}: expected this agent's node index in the plan "
                          "(`scaletrain plan` numbers them from 0)")
    return cfg, run_dir, resume, int(node) if node else None


def default_run_dir() -> Path:
    """runs/SCRIPT-TIME: the script's name and the time it started."""
    name = Path(sys.argv[0]).stem if sys.argv and sys.argv[0] not in ("", "-c") else "job"
    return Path(f"runs/{name}-{time.strftime('%Y%m%d-%H%M%S')}")
