"""A child process's death with its parent: no orphan outlives the process that started it."""

from __future__ import annotations

import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int) -> None:
    """Have the kernel kill this process (SIGKILL) when its parent dies, however it dies, kill -9
    included. A fork does not inherit it, so each generation sets its own: the starter, the job's
    processes, their beats and their loader processes. parent: the pid that started this process; if
    it died before the signal was set (this process was adopted meanwhile), exit now. The signal
    comes when the parent's thread that started this process ends: the main thread, for every
    caller here."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)
