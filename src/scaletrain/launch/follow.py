"""Following a submitted Slurm job: sbatch it, say each change of its state while it waits
(pending and why, running where, requeued), and name how it ended as Slurm does.

`scontrol show job` answers with no accounting database; Slurm forgets an ended job MinJobAge
seconds later, so the poll stays below half of that, and `sacct` is asked only after.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

from ..errors import LaunchError

ENDED = {"COMPLETED": "completed", "CANCELLED": "cancelled", "TIMEOUT": "timed out", "PREEMPTED": "preempted",
         "NODE_FAIL": "node failure", "FAILED": "failed", "OUT_OF_MEMORY": "out of memory",
         "BOOT_FAIL": "boot failure", "DEADLINE": "past its deadline"}


def submit(path: Path, wait: bool) -> int:
    """sbatch the script; with wait, follow the job to its end, say how it ended, return its status
    (0 completed, N for a job that failed with exit status N, 1 for any other end)."""
    try:
        r = subprocess.run(["sbatch", "--parsable", str(path)], capture_output=True, text=True)
    except FileNotFoundError:
        raise LaunchError("sbatch not found: run on a Slurm login node (or drop --submit)") from None
    if r.returncode:
        raise LaunchError(f"sbatch {path}: {(r.stderr.strip().splitlines() or ['exit status %d' % r.returncode])[-1]}")
    job = r.stdout.strip().split(";")[0]
    logs = path.parent / "logs"
    print(f"submitted batch job {job}; output in {logs}/slurm-{job}.out", flush=True)
    if not wait:
        return 0
    try:
        state, status, restarts = follow(job)
    except KeyboardInterrupt:
        print(f"scaletrain: stopped waiting; Slurm job {job} goes on (scancel {job} stops it)", file=sys.stderr)
        return 130
    again = f" after {restarts} requeue{'s' * (restarts > 1)}" if restarts else ""
    if state == "COMPLETED":
        print(f"Slurm job {job} completed{again}", flush=True)
        return 0
    how = ENDED.get(state, "ended, Slurm no longer says how" if state == "UNKNOWN" else state.lower())
    if state == "FAILED":
        code, _, sig = status.partition(":")
        how += f" (killed by signal {sig})" if sig not in ("", "0") else f" (exit status {code})"
    print(f"scaletrain: error: Slurm job {job} {how}{again}; see {logs}/slurm-{job}.out and {logs}",
          file=sys.stderr, flush=True)
    code = status.partition(":")[0]
    return int(code) if state == "FAILED" and code.isdigit() and int(code) else 1


def job_fields(job: str) -> dict[str, str] | None:
    """`scontrol show job` as a dict; None once Slurm no longer knows the job."""
    r = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True, text=True)
    if "Invalid job id" in r.stderr:
        return None
    if r.returncode or not r.stdout.strip():
        raise LaunchError(f"scontrol show job {job}: {(r.stderr.strip().splitlines() or ['no answer'])[-1]}")
    # A heterogeneous job answers a line per component: the first speaks for the job, the nodes are all.
    lines = [dict(kv.split("=", 1) for kv in line.split() if "=" in kv) for line in r.stdout.splitlines() if line]
    nodes = [f["NodeList"] for f in lines if f.get("NodeList") not in (None, "(null)")]
    return {**lines[0], **({"NodeList": ",".join(nodes)} if nodes else {})}


def state_line(job: str, f: dict[str, str], before: dict[str, str] | None) -> str | None:
    """A line for the job's state when it differs from `before` (None: nothing new to say).
    Pending says Slurm's reason; running, on which nodes; a requeue, how many so far."""
    state, reason, nodes = f.get("JobState", ""), f.get("Reason", "None"), f.get("NodeList", "")
    restarts = int(f.get("Restarts", "0") or 0)
    key = lambda d: (d.get("JobState"), d.get("Reason") if d.get("JobState") == "PENDING" else "",
                     d.get("NodeList") if d.get("JobState") == "RUNNING" else "", d.get("Restarts", "0"))
    if not state or state in ENDED or before is not None and key(f) == key(before):
        return None
    again = f" (requeued {restarts}x)" if restarts else ""
    if state == "PENDING":
        return f"Slurm job {job}: pending{again}" + (f", reason {reason}" if reason not in ("None", "") else "")
    if state == "RUNNING":
        return f"Slurm job {job}: running{again} on {nodes}"
    return f"Slurm job {job}: {state.lower().replace('_', ' ')}{again}" + \
        (f", reason {reason}" if reason not in ("None", "") else "")


def follow(job: str) -> tuple[str, str, int]:
    """Wait for the job to end: (JobState, ExitCode, Restarts), printing a line at each change of
    its state (`state_line`). A requeued job goes back to PENDING and runs again, so only an end
    state counts. Slurm forgets an ended job MinJobAge seconds later
    (no accounting here to ask then), so the poll stays below half of that."""
    cfg = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True).stdout
    age = re.search(r"^MinJobAge\s*=\s*(\d+)", cfg, re.M)
    cap, pause, restarts = max(1.0, min(30.0, int(age.group(1)) / 2 if age else 30.0)), 1.0, 0
    answered, before = time.monotonic(), None
    while True:
        try:
            f = job_fields(job)
            answered = time.monotonic()
        except LaunchError:  # a busy controller answers later; one silent for 5 minutes is an error
            if time.monotonic() - answered > 300:
                raise
            f = {}
        line = state_line(job, f, before) if f else None
        if line:
            print(line, flush=True)
            before = f
        if f is None:  # forgotten already (a slow poll): accounting, where there is one, still knows
            try:
                out = subprocess.run(["sacct", "-n", "-X", "-P", "-j", job, "-o", "State,ExitCode"],
                                     capture_output=True, text=True).stdout
            except OSError:
                out = ""
            state, _, status = (out.splitlines() or ["UNKNOWN|0:0"])[0].partition("|")
            return state.split()[0] if state else "UNKNOWN", status or "0:0", restarts
        restarts = int(f.get("Restarts", restarts))
        if f.get("JobState") in ENDED:
            return f["JobState"], f.get("ExitCode", "0:0"), restarts
        time.sleep(pause)
        pause = min(cap, pause * 2)
