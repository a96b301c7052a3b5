"""Flags of a calibration that cannot be true: figures that moved between rounds, a job's load
factor far beyond its microbenchmark, a host others kept busy. calibrate writes them to the
profile's [about] table; `predict --recommend` refuses a flagged profile without --force.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Each flag is one line naming the figure, its value and the bound; a flagged profile is kept (its
# figures say what went wrong) but `predict --recommend` refuses it without --force.

# (max - min) / median of a figure over the rounds. On this 2-core host a calibration beside little
# else moved the 1-replica step by 28% between rounds; one while other processes took 63% of the
# cores' time moved it by 78%, and the 4-byte latency by 148%. A figure that moved by half its
# median was measured through another process's spell, and its median decides little.
SPREAD_BOUND = 0.5
# A job's load factor: how much slower a job moves its bytes than the microbenchmark did. Beside
# little else on this host the all-reduce's came out 2.9 to 6.2 and the transfers' 4.5 (a job's other
# copies hold the cores loopback needs); with others taking 63% of the cores, 80 and 112. Ten times
# is not a cost of the job but of something else holding the cores while it ran.
LOAD_BOUND = 10.0
# The 1-minute load average against the cores before and after, less the calibration's own use of
# the cores: more than half of them already runnable means the figures were measured on a share.
BUSY_LOAD = 0.5
# Other processes' share of all the cores' time while the calibration ran (from /proc/stat, less
# this process's and its children's CPU time). On a quiet host, the system's few percent; a quarter
# is half a core of two, taken from jobs that size a core per replica.
OTHERS_BOUND = 0.25


def spread_flags(spreads: dict[str, float], bound: float = SPREAD_BOUND) -> list[str]:
    """A flag for each figure (NAME.FIGURE) whose spread over the rounds passes `bound`."""
    return [f"{name} varied by {x:.2f} of its median between rounds (bound {bound:g})"
            for name, x in spreads.items() if x > bound]


def load_flags(about: dict[str, Any], bound: float = LOAD_BOUND) -> list[str]:
    """A flag for each job's load factor ([about]'s allreduce_load, transfer_load) above `bound`."""
    what = {"allreduce_load": "the 2-replica job's all-reduce", "transfer_load": "the PS job's transfers"}
    return [f"{what[k]} {about[k]:.1f} x as slow as in the microbenchmark ({k}; bound {bound:g} x)"
            for k in what if about.get(k, 0.0) > bound]


@dataclass(frozen=True)
class Machine:
    """The host's load at one moment, as calibrate sees it before and after its rounds."""

    at: float         # time.monotonic() seconds
    load: float       # 1-minute load average (os.getloadavg)
    busy_s: float     # CPU seconds every process on the host has used since boot (/proc/stat; 0: none)
    total_s: float    # CPU seconds of all the host's CPUs, busy or idle, since boot (/proc/stat)
    own_s: float      # CPU seconds of this process and the children it has waited for (os.times)


def machine_now() -> Machine:
    """The host's load now. /proc/stat's first line counts every CPU's time in clock ticks by kind;
    idle and iowait are the idle ones. Without /proc (not Linux) only the load average is known."""
    t = os.times()
    busy = total = 0.0
    try:
        ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
        hz = os.sysconf("SC_CLK_TCK")
        total, busy = sum(ticks) / hz, (sum(ticks) - ticks[3] - ticks[4]) / hz
    except (OSError, ValueError, IndexError):
        pass
    return Machine(at=time.monotonic(), load=os.getloadavg()[0], busy_s=busy, total_s=total,
                   own_s=t.user + t.system + t.children_user + t.children_system)


def busy_flags(before: Machine, after: Machine, cores: int, load_bound: float = BUSY_LOAD,
               others_bound: float = OTHERS_BOUND) -> list[str]:
    """Flags for a host that others kept busy: its load average before, and after less the
    calibration's own mean use of the cores (a 1-minute average still holds the calibration's own
    jobs), above `load_bound` of the cores; other processes' share of the cores' time meanwhile
    above `others_bound`. The processes of a job are forks the calibration waits for, so their CPU
    time is its own."""
    out, limit = [], load_bound * cores
    own_cores = (after.own_s - before.own_s) / max(after.at - before.at, 1e-9)
    if before.load > limit:
        out.append(f"load average {before.load:.2f} before calibrating, on {cores} cores (bound {limit:.1f})")
    if after.load - own_cores > limit:
        out.append(f"load average {after.load:.2f} after calibrating, {after.load - own_cores:.2f} beyond its own "
                   f"{own_cores:.2f} cores, on {cores} cores (bound {limit:.1f})")
    elapsed = after.total_s - before.total_s
    if elapsed > 0:
        others = max(0.0, after.busy_s - before.busy_s - (after.own_s - before.own_s)) / elapsed
        if others > others_bound:
            out.append(f"other processes took {others:.0%} of the cores' time while calibrating "
                       f"(bound {others_bound:.0%})")
    return out
