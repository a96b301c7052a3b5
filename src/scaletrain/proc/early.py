"""Stop signals that come while a process is still starting: before its job can act on them.

Importing torch and the training code takes seconds (3-12 s, longer on a loaded node). A stop
signal then (scancel, a preemption, a requeue: SIGTERM at any moment) would kill the process with
status 143 and no word, where a wrapper that requeues on 75 expects a stop. So an entry point
calls `hold()` before its heavy imports, and the stop signals are recorded from then on. The next
owner of the signals takes the one that came: a job that has not begun stops before training,
saying so (`stopped`, exit 75); a process of a job that has asks its peers for a stop at the next
sync point (comm/end.catch_stop_signals); a command that runs no job lets it do what it would have
done (`release`). This module imports nothing heavy.
"""

from __future__ import annotations

import signal
from pathlib import Path

from ..errors import EXIT_STOPPED, Stopped

# cluster.stop_signals' default and Ctrl-C: the recipe, which may name others, is not read yet.
HELD = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)

_came: list[int] = []
_before: dict = {}


def _record(signum, frame) -> None:
    if not _came:
        _came.append(signum)


def hold() -> None:
    """From now on the stop signals are recorded, not acted on, until `take`."""
    for s in HELD:
        _before[s] = signal.signal(s, _record)


def came() -> int:
    """The first stop signal recorded since `hold` (0: none)."""
    return _came[0] if _came else 0


def take(replaced: dict | None = None) -> int:
    """End the hold; the signal that came during it (0: none). The handlers `hold` found go back in
    place; or, where `replaced` (what signal.signal returned as the next owner's handlers went in)
    holds this module's, they go there instead, for that owner to put back."""
    for s, h in _before.items():
        if replaced is not None and replaced.get(s) is _record:
            replaced[s] = h
        elif signal.getsignal(s) is _record:
            signal.signal(s, h)
    _before.clear()
    got = came()
    _came.clear()
    return got


def release() -> None:
    """End the hold in a command that runs no job: a signal that came does now what it would have."""
    got = take()
    if got:
        signal.raise_signal(got)


def stopped(signum: int, run_dir: Path) -> Stopped:
    """The stop of a job that a signal ended before training began: nothing to checkpoint."""
    ckpts = sorted(Path(run_dir, "checkpoints").glob("ckpt-*.pt"))
    kept = f"; its checkpoints in {ckpts[0].parent} are kept as they were" if ckpts else ""
    return Stopped(f"stopped by {signal.Signals(signum).name} before training began: nothing to checkpoint{kept}",
                   130 if signum == signal.SIGINT else EXIT_STOPPED)


def check(run_dir: Path) -> None:
    """Raise `stopped` if a stop signal came since `hold`."""
    if came():
        raise stopped(came(), run_dir)
