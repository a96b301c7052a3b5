"""Measurements taken in rounds, every figure once a round, with a line of progress before each.

A calibration takes minutes to hours (three rounds of several training jobs): each line says
which measurement runs, how far the whole has come, and how long is left, from the times the
measurements took in the rounds before.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any


def rounds(measures: dict[str, Any], runs: int, say=print, clock=time.monotonic,
           tell=None) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
    """Call every measure (name -> fn returning a dict of figures) once a round, for `runs`
    rounds, so that a slow spell of the host falls on every figure alike; a line before each
    says how far it has come and how long is left (eta), and one on stderr (`tell`) after each
    round, where the lines of the figures' jobs do not bury it. Returns each figure's median
    over the rounds, and its spread: (max - min) / median, keyed NAME.FIGURE."""
    tell = tell or (lambda line: print(line, file=sys.stderr, flush=True))
    results: dict[str, list[dict[str, float]]] = {name: [] for name in measures}
    took: dict[str, list[float]] = {name: [] for name in measures}
    start, total = clock(), runs * len(measures)
    for j in range(runs):
        say(f"  round {j + 1} of {runs}: " + ", ".join(measures))
        for i, (name, measure) in enumerate(measures.items()):
            done = j * len(measures) + i
            say(f"    {name}: {done + 1} of {total}, {duration(clock() - start)} in{eta(took, runs - j, i)}")
            t0 = clock()
            results[name].append(measure())
            took[name].append(clock() - t0)
        tell(f"calibrate: round {j + 1} of {runs} done, {duration(clock() - start)} in"
             f"{eta(took, runs - j, len(measures))}")
    medians, spreads = {}, {}
    for name, rs in results.items():
        medians[name] = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        for k, m in medians[name].items():
            spreads[f"{name}.{k}"] = round((max(r[k] for r in rs) - min(r[k] for r in rs)) / m if m else 0.0, 4)
    return medians, spreads


def eta(took: dict[str, list[float]], rounds_left: int, at: int) -> str:
    """Words for the time left (measure `at` of this round on, then `rounds_left` - 1 rounds), each
    measure taking the median of its times so far; a lower bound while some have not run yet."""
    names = list(took)
    todo = names[at:] + names * (rounds_left - 1)
    known = [statistics.median(took[n]) for n in todo if took[n]]
    if not known:
        return ""
    return f", {'about' if len(known) == len(todo) else 'at least'} {duration(sum(known))} left"


def duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds // 3600:.0f} h {seconds % 3600 / 60:.0f} min"
