"""Start a distributed job's processes and see it through: the local launcher, or one Slurm step
inside an allocation.

A job that fails is started again from its newest complete checkpoint, up
to cluster.max_restarts times; without the failed worker node when
cluster.min_nodes allows (allreduce: train.steps is rescaled so that the
job's target stays the same images). The processes run the built-in loop
(launch/entry.py), or a user's script (`script`: job.Job.from_env started
outside any launcher), which each process runs again from its start and
which finds the run directory and whether to resume in SCALETRAIN_RUN_DIR
and SCALETRAIN_RESUME, and the job's config in RUN_DIR/config.toml (the
one the launcher resolved: its port, a restart's node count).
"""

from __future__ import annotations

import json
import math
import sys
from functools import partial
from pathlib import Path
from typing import Any

from ..checkpoint import list_complete, position, write_file
from ..data import check_data
from ..device import facts
from ..errors import (EXIT_STOPPED, REPORTED, ConfigError, Finished, LaunchError, PlanError, RunError,
                      Stopped)
from ..models import check_network
from ..plan import lost_nodes
from ..rundir import prepare_run_dir
from ..schedule import step_images
from . import local, slurm
from ..proc import early, env as launch_env


def run(cfg, run_dir: Path, resume: bool, progress: bool, script: list[str] | None = None) -> dict[str, Any]:
    """Run the job to its end, restarting it as cluster.max_restarts allows; its summary. Raises as
    run.run_training says."""
    # Before the launcher makes the run directory: a network or data its processes cannot use leaves
    # none behind. A network by import path is built here once, on CPU (models/factory.py); a
    # manifest's files are checked here once for the job, and the check recorded for its chief.
    check_network(cfg)
    check_data(cfg, run_dir)
    early.check(run_dir)  # a stop signal meanwhile: the processes are not started (proc/early.py)
    start = slurm.run_job if launch_env.in_slurm_allocation() else local.launch
    restarts, failure = 0, run_dir / "logs" / "failure.json"
    lost: list[dict] = []  # the worker nodes restarts left out, for summary.json's lost_workers
    excluded: list[str] = []  # their hosts, under Slurm
    while True:
        failure.unlink(missing_ok=True)
        rc = start(cfg, run_dir, resume=resume, progress=progress, script=script)
        if rc == 0 and (run_dir / "summary.json").exists():
            return _with_lost(run_dir, lost)
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
        failed, without = cfg, ""
        smaller = _without(cfg, culprit)
        if smaller is not None:
            cfg, node = smaller, culprit["node"]
            without = f" without node {node + 1} ({cfg.cluster.nodes} worker nodes, cluster.min_nodes = " \
                      f"{cfg.cluster.min_nodes})"
            if launch_env.in_slurm_allocation():
                excluded.append(culprit.get("host"))
                start = partial(start, exclude=tuple(excluded))
        line, images = _restart_from(run_dir, failed, cfg)
        if smaller is not None:  # ranks of the job that lost it; its nodes numbered from 1, as the messages
            plan = launch_env.plan_for(failed)
            lost.append({**lost_nodes(plan, [p.rank for p in plan.procs if p.node == node]),
                         "host": culprit.get("host"), "restart": restarts,
                         "images": images, "step": images // step_images(cfg)})
        print(f"scaletrain: {culprit['what']}; restart {restarts} of {cfg.cluster.max_restarts}{without}: {line}",
              file=sys.stderr, flush=True)


def run_script(cfg, run_dir: Path, resume: bool, progress: bool, script: list[str]) -> int:
    """A user's script as every process of cfg's job (job.Job.from_env): the exit status, with the
    reason in one line on stderr where it failed."""
    try:
        launch_env.plan_for(cfg, None if launch_env.in_slurm_allocation() else facts())
        resume = prepare_run_dir(run_dir, resume, cfg)
        run(cfg, run_dir, resume, progress, script)
    except REPORTED as e:
        return report(e, run_dir)
    return 0


def report(e: BaseException, run_dir: Path | None) -> int:
    """Say in one line how a job that its starter ran (one of errors.REPORTED) ended; its exit status:
    2 a job that cannot start as asked (a ModelNameError among them), 1 one that failed, a stopped
    job's, 130 Ctrl-C, 0 a run that was already over."""
    if isinstance(e, Finished):  # nothing to do: the run's results stand as they are
        print(f"scaletrain: {e}")
        return 0
    if isinstance(e, KeyboardInterrupt):
        where = e or f"the newest checkpoint in {run_dir / 'checkpoints'} is complete"
        print(f"scaletrain: interrupted; {where}", file=sys.stderr)
        return 130
    if isinstance(e, Stopped):
        print(f"scaletrain: {e}", file=sys.stderr)
        return e.status
    print(f"scaletrain: error: {e}", file=sys.stderr)
    return 2 if isinstance(e, (PlanError, LaunchError, ConfigError)) else 1


def _without(cfg, culprit: dict):
    """The config of a restart that leaves the failed worker node out, when cluster.min_nodes
    allows it; None otherwise. The target stays the same images: train.steps counts global
    batches, which get smaller."""
    c = cfg.cluster
    if culprit.get("node") is None or culprit.get("role") != "worker" or not c.min_nodes or c.nodes - 1 < c.min_nodes:
        return None
    sets = {"cluster.nodes": c.nodes - 1}
    if cfg.train.steps:
        sets["train.steps"] = math.ceil(cfg.train.steps * c.nodes / (c.nodes - 1))
    return cfg.replace(**sets)


def _with_lost(run_dir: Path, lost: list[dict]) -> dict[str, Any]:
    """The run's summary, with the worker nodes restarts left out added to the job's own lost_workers."""
    path = run_dir / "summary.json"
    summary = json.loads(path.read_text())
    if lost:
        summary["lost_workers"] = lost + summary.get("lost_workers", [])
        write_file(path, (json.dumps(summary, indent=2) + "\n").encode(), "the summary")
    return summary


def _checkpoints(run_dir: Path) -> list[int]:
    return [step for step, _ in list_complete(run_dir / "checkpoints")]


def _logged(run_dir: Path) -> tuple[int, int]:
    """The step and images of the newest metrics row; (0, 0) before the first."""
    try:
        rows = [json.loads(r) for r in (run_dir / "metrics.jsonl").read_text().splitlines()[-50:] if r.strip()]
    except (OSError, ValueError):
        return 0, 0
    newest = max(rows, key=lambda r: r.get("images", 0), default={})
    return newest.get("step", 0), newest.get("images", 0)


def _restart_from(run_dir: Path, failed, cfg) -> tuple[str, int]:
    """What a restart of the job `failed` as `cfg` resumes from, in words, and the images applied
    there: the step is said as cfg's job counts it (another count where a node was left out), the
    logged steps lost as the failed job's."""
    at = position(run_dir / "checkpoints")
    step, images = _logged(run_dir)
    if at is None:
        return f"no checkpoint yet: starting again from step 0 ({step} steps lost)", 0
    saved, applied = at
    resumes = applied // step_images(cfg)
    lost = max(images - applied, 0) // step_images(failed)
    return (f"resuming from the checkpoint of step {saved}"
            + (f", which is step {resumes} with {cfg.cluster.nodes} worker nodes" if resumes != saved else "")
            + f" ({lost} logged steps lost)"), applied


def _where(run_dir: Path) -> str:
    """Where a stopped job stands: its newest checkpoint."""
    steps = _checkpoints(run_dir)
    if not steps:
        return "stopped before its first checkpoint"
    return f"stopped at step {steps[-1]}; its checkpoint is complete; the same command continues the run"
