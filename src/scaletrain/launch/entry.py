"""What every process of a distributed job runs with the built-in loop: join, take a role, work, report.

`python -m scaletrain.launch.entry RUN_DIR` runs it with the resolved config
in RUN_DIR/config.toml (the local launcher and Slurm jobs start it so);
`scaletrain train` and `scaletrain.train` under torchrun or srun call
`process` with the recipe's.
The process's rank and the job's rendezvous come from the launcher's
environment (proc/env.py); joining and ending are launch/join.py's, the
same for a user's script (job.Job.from_env).
"""

from __future__ import annotations

if __name__ == "__main__":  # a task of a Slurm step: stop signals held through the imports below
    from ..proc.early import hold

    hold()

import argparse
import logging
from pathlib import Path
from typing import Any

from ..config import load_config
from ..loop import train
from .join import end_or_exit, exit_now, join_or_exit


def process(cfg, run_dir: Path, resume: bool, progress: bool, node: int | None = None) -> dict[str, Any]:
    """Be one process of the job: join, then serve a shard or train, and end with the others. Returns
    the job's summary on the chief, {} on the other workers; a process that could not join, a
    parameter server, a failed or a stopped one exits here with its status (launch/join.py)."""
    ctx = join_or_exit(cfg, run_dir, resume, progress, node)
    try:
        summary = train(cfg, run_dir, resume=resume, progress=progress, ctx=ctx)
    except BaseException as e:  # noqa: BLE001 - the peers are told; this process exits with its status
        end_or_exit(ctx, e)
        raise
    end_or_exit(ctx, None)
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scaletrain.launch.entry")
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--quiet", action="store_true")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    process(load_config(a.run_dir / "config.toml"), a.run_dir, a.resume, not a.quiet)
    return 0


if __name__ == "__main__":
    exit_now(main())
