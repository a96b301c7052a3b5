"""The notes a job's processes and launchers leave in RUN_DIR/logs (rankR.lost, dropped, exited-R),
and how a process's end is said. Light: a keeper (keep.py) imports it and never imports torch."""

from __future__ import annotations

import os
import signal
from pathlib import Path


def ranks_in(path: Path) -> list[int] | None:
    """The ranks a note lists; [] where there is none yet, None where it could not be read now (a
    file system's passing error): the reader keeps what it knew."""
    try:
        return [int(r) for r in path.read_text().split(",") if r.strip()]
    except FileNotFoundError:
        return []
    except (OSError, ValueError):
        return None


def read_ranks(run_dir: Path, name: str) -> list[int]:
    """Ranks listed in RUN_DIR/logs/NAME, [] where it cannot be read: those a process that exited with
    EXIT_PEER left because of (rankR.lost, comm.liveness.write_note), or those the job went on
    without (dropped)."""
    return ranks_in(run_dir / "logs" / name) or []


def write_ranks(run_dir: Path, name: str, ranks: list[int]) -> None:
    """RUN_DIR/logs/NAME listing `ranks`, replaced whole: a reader never sees half of it."""
    part = run_dir / "logs" / f".{name}.part"
    part.write_text(",".join(map(str, ranks)) + "\n")
    os.replace(part, run_dir / "logs" / name)


def describe_exit(plan, rank: int, rc: int | None) -> str:
    """How rank `rank` ended, named: rc as Popen gives it (-N: killed by signal N), None: killed as frozen."""
    if rc is None:
        how = "stopped answering (frozen or hung) and was killed"
    elif rc < 0:
        how = f"was killed by signal {signal.Signals(-rc).name}"
    else:
        how = f"exited with status {rc}"
    return f"{plan.describe(rank)} {how}"


def stop_signals_of(names: tuple[str, ...]) -> list[int]:
    return [getattr(signal, n) for n in names]
