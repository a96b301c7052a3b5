"""The Python API: what a script calls, beside the command line.

    import scaletrain
    summary = scaletrain.train("recipes/digits.toml", {"strategy.name": "sync", "cluster.nodes": 2})

trains as `scaletrain train` does (a single process here; a distributed config with the local
launcher, under torchrun or srun, or as a step of the Slurm allocation it runs in) and returns the
summary. A user's own loop takes `Job` (job.py) the same way under any of them:

    with scaletrain.Job.from_env(scaletrain.load_config("recipe.toml")) as job:
        model, optimizer = job.wrap(model)
        for x, y in job.batches(): ...; loss.backward(); job.step(loss)
    figures = job.figures()
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .config import Config, build_config, load_config, toml_value
from .job import Job
from .models import build_model
from .proc.env import run_dir_for
from .run import run_training, warn_slow_input

__all__ = ["Config", "Job", "build_model", "load_config", "train"]


def train(config_or_recipe: Config | str | Path, overrides: Mapping[str, Any] | Sequence[str] = (),
          run_dir: str | Path | None = None, resume: bool = False, progress: bool = True) -> dict[str, Any]:
    """Train a job and return its summary (summary.json): the job `scaletrain train` runs.

    config_or_recipe: a Config (built in Python; checked here as a recipe is) or a TOML recipe's path.
    overrides: {"key.name": value} or ["key.name=value", ...], as --set takes them.
    run_dir: the run's directory (default runs/RECIPE-TIME; under torchrun or srun each process must
    be given the same one); resume: continue the run in it.
    Raises ConfigError, PlanError or LaunchError for a job that cannot start as asked, one of
    errors.USER_ERRORS for one that failed, Stopped when a stop signal ended it after its checkpoint:
    str() of each is one line. Under torchrun or srun this process is one of the job's: it returns
    the summary on the chief and {} on the other workers, and a process that fails, is stopped or
    serves a parameter-server shard exits inside with its status, its peers told."""
    sets = [f"{k}={toml_value(v)}" for k, v in overrides.items()] if isinstance(overrides, Mapping) else list(overrides)
    if isinstance(config_or_recipe, Config):
        cfg, name = build_config(config_or_recipe.to_dict(), sets, origin="the Config given"), "job"
    else:
        cfg, name = load_config(config_or_recipe, sets), str(config_or_recipe)
    summary = run_training(cfg, run_dir_for(name, str(run_dir) if run_dir else None, cfg), resume=resume,
                           progress=progress)
    warn_slow_input(summary, cfg)
    return summary
