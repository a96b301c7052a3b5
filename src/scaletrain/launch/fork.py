"""The local launcher's processes, forked from one process that imported torch once.

Every job process imports torch, torch._dynamo (torch.optim imports it at an
optimizer's first parameter group) and its data source's library (sklearn for
the digits): seconds of CPU each. N processes doing that at once on a machine
of few cores spend N times the CPU before they meet, and reach the rendezvous
far apart. The starter (`python -m scaletrain.launch.starter RUN_DIR ...`,
launch/starter.py) imports them once and forks every process of the job; their
pages stay shared (copy on write) and a process is up in milliseconds. This
module holds the launcher's side; proc/parent.py's die_with_parent, which every generation of
processes calls (the job's processes, their beats, their loader processes); it
imports nothing of the package. The starter's own program, which imports the
job's code at its top, is launch/starter.py.

Forking is safe here: the starter runs no Python thread and initialises no
GPU (each process does, after the fork, as before); the BLAS libraries that
numpy and scipy load stop their thread pools across a fork.

The launcher writes one JSON line per process (its argv for entry.main, its
environment, its log, or none for the terminal), reads back its pid and opens
a pidfd on it (a signal sent through a pidfd never reaches a later process
that got the same pid), then writes `go`. Only then does the starter reap the
processes it forked, reporting `pid status` for each (-N: killed by signal N,
as subprocess says). Every process has the kernel's parent-death signal set
to SIGKILL toward the starter, and the starter toward the launcher: whatever
kills the launcher takes them all.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path


class Forked:
    """A process the starter forked: as much of subprocess.Popen as the launcher uses."""

    def __init__(self, pid: int, codes: dict) -> None:
        self.pid, self.codes, self.returncode = pid, codes, None
        self.fd = os.pidfd_open(pid)

    def poll(self) -> int | None:
        self.returncode = self.codes.get(self.pid)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                signal.pidfd_send_signal(self.fd, sig)
            except ProcessLookupError:  # it ended since
                pass


class Starter:
    """The launcher's side: start the starter, ask it for processes, learn how they end."""

    def __init__(self, run_dir: Path, env: dict, setup) -> None:
        to_r, to_w = os.pipe()
        back_r, back_w = os.pipe()
        self.proc = subprocess.Popen([sys.executable, "-m", "scaletrain.launch.starter", str(run_dir), str(to_r),
                                      str(back_w)], env=env, pass_fds=(to_r, back_w), preexec_fn=setup)
        os.close(to_r)
        os.close(back_w)
        self.to, self.back = os.fdopen(to_w, "w"), os.fdopen(back_r, "r")
        self.codes: dict[int, int] = {}
        self.procs: list[Forked] = []

    def start(self, specs: list[dict]) -> list[Forked]:
        """Fork one process per spec ({argv, env, log}); returns them in that order."""
        self.to.write("".join(json.dumps(s) + "\n" for s in specs))
        self.to.flush()
        for _ in specs:
            line = self.back.readline()
            if not line:
                raise OSError(f"the process starter ended (status {self.proc.wait()}) before it forked every process")
            self.procs.append(Forked(int(line), self.codes))
        self.to.write("go\n")  # every pid has its pidfd: the starter may reap them now
        self.to.flush()
        threading.Thread(target=self._reports, daemon=True).start()
        return self.procs

    def _reports(self) -> None:
        for line in self.back:
            pid, code = map(int, line.split())
            self.codes[pid] = code
        # The starter is gone: a process it did not report died with it (parent-death signal).
        for p in self.procs:
            self.codes.setdefault(p.pid, -signal.SIGKILL)

    def close(self) -> None:
        """Kill what still runs (nothing, after a job that ended), and wait for the starter."""
        for p in self.procs:
            p.send_signal(signal.SIGKILL)
        self.to.close()
        self.proc.wait()
        for p in self.procs:
            os.close(p.fd)
