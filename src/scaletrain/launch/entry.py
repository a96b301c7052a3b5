"""What every process of a distributed job runs with the built-in loop: join, take a role, work, report.

`python -m scaletrain.launch.entry RUN_DIR` runs it with the resolved config
in RUN_DIR/config.toml (the local launcher and Slurm jobs start it so);
`scaletrain train` under torchrun or srun calls `run` with the recipe's.
The process's rank and the job's rendezvous come from the launcher's
environment (launch/env.py); joining and ending are launch/join.py's, the
same for a user's script (job.Job.from_env).
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from ..config import load_config
from ..loop import train
from .join import ending, exit_now, join, serve


def run(cfg, run_dir: Path, resume: bool, progress: bool, node: int | None = None) -> int:
    """Be one process of the job: join, serve a shard or train, end with the others. Returns the
    exit status."""
    ctx = join(cfg, run_dir, progress, node)
    if isinstance(ctx, int):
        return ctx
    try:
        if ctx.me.role == "ps":
            serve(cfg, ctx, run_dir, resume)
        else:
            train(cfg, run_dir, resume=resume, progress=progress, ctx=ctx)
    except BaseException as e:  # noqa: BLE001 - mapped to the exit status; the peers are told
        return ending(ctx, e)
    return ending(ctx, None)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scaletrain.launch.entry")
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--quiet", action="store_true")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    return run(load_config(a.run_dir / "config.toml"), a.run_dir, a.resume, not a.quiet)


if __name__ == "__main__":
    exit_now(main())
