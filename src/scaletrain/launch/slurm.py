"""Slurm: an sbatch script from the plan, the job step that starts every process, and the job's end.

`scaletrain slurm` writes RUN_DIR/config.toml (the resolved config) and
RUN_DIR/job.sbatch, and with --submit hands it to sbatch. The script asks
for the plan's node count and process count and runs `scaletrain train`,
which in the batch step (`run_job`) starts one srun step with every process
of the plan. Nodes may run different numbers of processes (a PS alongside),
so the step uses --distribution=arbitrary with a host file that names, for
each global rank in order, the host of its plan node: task i is rank i, on
the node the plan gives it (each process checks SLURM_NODEID against the plan).

What the script asks of Slurm, and why:
- --cpus-per-task: a worker's data.workers loader processes plus its training
  threads (train.threads, at least 1). One step has one count for all its
  tasks, so a PS (no loader) gets a worker's count too: at most
  data.workers idle CPUs per PS, against a worker short of CPUs otherwise.
- --signal=B:USR1@S (S from --warn-before, default 300 s, 0 = none): the
  warning reaches the batch process only, `run_job`, which passes it to every
  task of the step; the job checkpoints at the next step all processes
  agree on and stops with status 75. S must cover that step plus the save.
  Slurm may send it up to a minute early.
- --requeue: after such a stop `run_job` asks Slurm to queue the job again;
  the next run (SLURM_RESTART_COUNT set) resumes from the checkpoint in RUN_DIR.
  --no-requeue writes --no-requeue instead (the job then just stops).
- --open-mode=append: every run of a requeued job writes to the same
  logs/slurm-JOB.out; Slurm would truncate it at each start otherwise.
- --time, --partition, --account: as given.

When a task ends, srun gives the others cluster.timeout_s + 5 s to end on
their own, as the local launcher does (their heartbeats see a lost peer in
timeout_s and say which), then kills them. It does not kill them at the first
non-zero status (--kill-on-bad-exit): after a stop at a checkpoint every task
exits 75 a moment apart, and one killed on its way out would turn the step's
status into 137 and lose the requeue.

Signals in the batch step: srun forwards SIGUSR1 to its tasks but answers
SIGTERM by killing the step, with no checkpoint. So `run_job` forwards both
with `scancel --signal=SIG JOB.STEP`, which delivers the signal and nothing
more; it finds its step by the step name it gave srun.

`submit(wait=True)` follows the job with `scontrol show job` (no accounting
database needed) and names how it ended as Slurm does: completed (also after
requeues), cancelled, timed out, preempted, node failure, or failed (exit
status N).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from .. import strategies
from ..config import Config, dump_toml
from ..errors import EXIT_STOPPED
from ..plan import format_table
from .env import LaunchError, plan_for, slurm_hosts, slurm_port
from .local import read_ranks, write_failure

WARNING = signal.SIGUSR1  # what --signal=B:USR1 sends before the time limit
ENDED = {"COMPLETED": "completed", "CANCELLED": "cancelled", "TIMEOUT": "timed out", "PREEMPTED": "preempted",
         "NODE_FAIL": "node failure", "FAILED": "failed", "OUT_OF_MEMORY": "out of memory",
         "BOOT_FAIL": "boot failure", "DEADLINE": "past its deadline"}


def cpus_per_task(cfg: Config) -> int:
    """CPUs a worker uses: its loader processes and its training threads (a PS needs fewer)."""
    return cfg.data.workers + max(1, cfg.train.threads)


def time_seconds(text: str) -> int | None:
    """A Slurm time limit in seconds (MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS); None = unlimited."""
    if text.strip().lower() in ("unlimited", "infinite"):
        return None
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text.strip())
    if not m:
        raise LaunchError(f"--time {text!r}: Slurm takes MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS")
    days, *rest = m.groups()
    parts = [int(p) for p in rest if p is not None]
    if days is not None:  # D-HH[:MM[:SS]]
        return int(days) * 86400 + sum(p * u for p, u in zip(parts, (3600, 60, 1)))
    units = {1: (60,), 2: (60, 1), 3: (3600, 60, 1)}[len(parts)]
    return sum(p * u for p, u in zip(parts, units))


def script(cfg: Config, run_dir: Path, train_args: list[str], partition: str = "", time: str = "",
           account: str = "", warn_before: int = 300, requeue: bool = True) -> str:
    """The sbatch script: the plan's nodes and tasks, then `scaletrain train` (which, in the
    batch step of an allocation, starts the job step below)."""
    plan = plan_for(cfg)
    run_dir = run_dir.resolve()
    limit = time_seconds(time) if time else None
    if warn_before < 0:
        raise LaunchError(f"--warn-before {warn_before}: give seconds >= 0 (0 = no warning)")
    if warn_before and WARNING.name not in cfg.cluster.stopping:
        raise LaunchError(f"cluster.stop_signals = {cfg.cluster.stop_signals!r} lacks {WARNING.name}, the warning "
                          f"signal of --warn-before: add it, or give --warn-before 0")
    if warn_before and limit is not None and warn_before >= limit:
        raise LaunchError(f"--warn-before {warn_before} s is not shorter than --time {time} ({limit} s): the job "
                          f"would be told to stop as it starts; give --warn-before below {limit} (0 = no warning)")
    opts = [f"--job-name=scaletrain-{run_dir.name}", f"--nodes={plan.nodes_total}", f"--ntasks={plan.world_size}",
            f"--cpus-per-task={cpus_per_task(cfg)}", f"--output={run_dir}/logs/slurm-%j.out", "--open-mode=append",
            "--requeue" if requeue else "--no-requeue"]
    opts += [f"--signal=B:{WARNING.name[3:]}@{warn_before}"] if warn_before else []
    if cfg.train.device != "cpu":
        opts.append(f"--gpus-per-node={cfg.cluster.gpus_per_node}")
    opts += [f"--{k}={v}" for k, v in (("partition", partition), ("time", time), ("account", account)) if v]
    cmd = [sys.executable, "-m", "scaletrain", "train", *train_args, "--run-dir", str(run_dir)]
    placement = format_table(plan).splitlines()[: plan.nodes_total + 1]
    return "\n".join(["#!/bin/bash", *(f"#SBATCH {o}" for o in opts),
                      "# Written by scaletrain; the placement (`scaletrain plan`):",
                      *(f"#   {line}" for line in placement),
                      "# Every process finds its role from SLURM_PROCID, SLURM_NODEID and the plan.",
                      "# A requeued run (SLURM_RESTART_COUNT set) continues from the newest checkpoint.",
                      f"mkdir -p {shlex.quote(str(run_dir / 'logs'))}",
                      "exec " + shlex.join(cmd) + " ${SLURM_RESTART_COUNT:+--resume}", ""])


def write(cfg: Config, run_dir: Path, resume: bool = False, **opts) -> Path:
    """RUN_DIR/config.toml (the resolved config, which the job reads) and RUN_DIR/job.sbatch."""
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(dump_toml(cfg))
    path = run_dir / "job.sbatch"
    args = ["--recipe", str((run_dir / "config.toml").resolve())] + (["--resume"] if resume else [])
    path.write_text(script(cfg, run_dir, args, **opts))
    return path


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
    return dict(kv.split("=", 1) for kv in r.stdout.split() if "=" in kv)


def follow(job: str) -> tuple[str, str, int]:
    """Wait for the job to end: (JobState, ExitCode, Restarts). A requeued job goes back to PENDING
    and runs again, so only an end state counts. Slurm forgets an ended job MinJobAge seconds later
    (no accounting here to ask then), so the poll stays below half of that."""
    cfg = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True).stdout
    age = re.search(r"^MinJobAge\s*=\s*(\d+)", cfg, re.M)
    cap, pause, restarts = max(1.0, min(30.0, int(age.group(1)) / 2 if age else 30.0)), 1.0, 0
    answered = time.monotonic()
    while True:
        try:
            f = job_fields(job)
            answered = time.monotonic()
        except LaunchError:  # a busy controller answers later; one silent for 5 minutes is an error
            if time.monotonic() - answered > 300:
                raise
            f = {}
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


def run_job(cfg: Config, run_dir: Path, resume: bool = False, progress: bool = True, exclude=()) -> int:
    """Inside an allocation: start every process of the plan with one srun step, pass SIGTERM and
    the warning signal on to every task, and requeue the job when the warning stopped it.
    exclude: hosts of the allocation left out (a failed node, see run.py)."""
    plan = plan_for(cfg)
    job = os.environ.get("SLURM_JOB_ID", "0")
    hosts = slurm_hosts(plan, os.environ, exclude)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    for note in [*(run_dir / "logs").glob("rank*.lost"), run_dir / "logs" / "dropped"]:  # an earlier attempt's
        note.unlink(missing_ok=True)
    (run_dir / "config.toml").write_text(dump_toml(cfg))  # what every process of the step reads
    hostfile = run_dir / "logs" / f"hosts-{job}.txt"
    hostfile.write_text("".join(f"{hosts[p.node]}\n" for p in plan.procs))
    port = cfg.cluster.master_port or slurm_port(job)
    print(f"Slurm job {job}: {plan.world_size} processes on {', '.join(hosts[:plan.nodes_total])}; "
          f"rendezvous {hosts[0]}:{port}", flush=True)
    name = f"scaletrain-{job}-{os.getpid()}"  # how the signal forwarder finds this step
    # After a task ends, srun waits that long for the others: the heartbeats' bound, or for ever in a
    # job that goes on without a lost worker node (its processes end on their own; liveness.py).
    tolerant = strategies.tolerant(cfg)
    cmd = ["srun", f"--job-name={name}", f"--ntasks={plan.world_size}", f"--nodes={plan.nodes_total}",
           f"--cpus-per-task={cpus_per_task(cfg)}", "--distribution=arbitrary", "--kill-on-bad-exit=0",
           f"--wait={0 if tolerant else int(cfg.cluster.timeout_s) + 5}", "--overcommit", sys.executable, "-m", "scaletrain.launch.entry", str(run_dir)]
    cmd += (["--resume"] if resume else []) + ([] if progress else ["--quiet"])
    env = dict(os.environ, SLURM_HOSTFILE=str(hostfile), SCALETRAIN_THREADS=str(max(1, cfg.train.threads)))
    step: list[subprocess.Popen] = []
    got: list[int] = []
    started = time.time()

    def forward(sig, _frame):
        got.append(sig)
        if step:
            forward_signal(job, name, sig, step[0])

    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, WARNING)}
    try:
        step.append(subprocess.Popen(cmd, env=env))
        for sig in got:  # arrived while srun was starting
            forward_signal(job, name, sig, step[0])
        rc = step[0].wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if step and step[0].poll() is None:  # never leave the step behind this process
            step[0].terminate()  # srun kills the step's tasks on SIGTERM
            try:
                step[0].wait(60)
            except subprocess.TimeoutExpired:
                step[0].kill()
                step[0].wait()
    if rc == EXIT_STOPPED and WARNING in got:
        requeue(job, run_dir)
    if rc not in (0, EXIT_STOPPED, 130):
        _name_culprit(run_dir, plan)
    summary = run_dir / "summary.json"
    if rc not in (0, EXIT_STOPPED) and tolerant and (run_dir / "logs" / "dropped").exists() and \
            summary.exists() and summary.stat().st_mtime >= started:
        print(f"scaletrain: the job went on without node(s) it lost (see lost_workers in {summary}) and ended; "
              f"srun's status {rc} is theirs", flush=True)
        return 0
    return rc


def _name_culprit(run_dir: Path, plan) -> None:
    """logs/failure.json for run.py: the process most of the others left because of (their
    rankR.lost notes, dist.write_note), with the host it ran on."""
    named = [r for note in (run_dir / "logs").glob("rank*.lost") for r in read_ranks(run_dir, note.name)]
    if not named:
        return
    rank = max(sorted(set(named)), key=named.count)
    try:
        host = json.loads((run_dir / "logs" / f"rank{rank}.json").read_text()).get("SLURMD_NODENAME")
    except (OSError, ValueError):
        host = None
    write_failure(run_dir, plan, rank, f"{plan.describe(rank)} failed or went silent (see its log)", host)


def forward_signal(job: str, name: str, sig: int, step: subprocess.Popen) -> None:
    """Send sig to every task of the step called name (srun registers it a moment after it starts)."""
    sig_name = signal.Signals(sig).name[3:]
    deadline = time.monotonic() + 30
    while step.poll() is None and time.monotonic() < deadline:
        q = subprocess.run(["squeue", "-h", "-s", "-j", job, "-o", "%i %j"], capture_output=True, text=True)
        ids = [line.split()[0] for line in q.stdout.splitlines() if line.split()[1:] == [name]]
        if ids:  # scancel fails only for a step that is ending already
            subprocess.run(["scancel", f"--signal={sig_name}", ids[0]], capture_output=True)
            return
        time.sleep(0.5)
    if step.poll() is None:
        print(f"scaletrain: error: Slurm step {name} of job {job} not found: SIG{sig_name} not passed on",
              file=sys.stderr, flush=True)


def requeue(job: str, run_dir: Path) -> None:
    """Queue the job again after a stop at a checkpoint, when it may be requeued."""
    try:
        f = job_fields(job) or {}
    except LaunchError as e:
        f = {"Requeue": f"unknown ({e})"}
    if f.get("Requeue") != "1":
        print(f"scaletrain: Slurm job {job} stopped at a checkpoint and may not be requeued; "
              f"`sbatch {run_dir / 'job.sbatch'}` continues it", file=sys.stderr, flush=True)
        return
    print(f"scaletrain: requeueing Slurm job {job}; it resumes from the checkpoint in {run_dir}", flush=True)
    r = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
    if r.returncode:
        print(f"scaletrain: error: scontrol requeue {job}: {r.stderr.strip()}", file=sys.stderr, flush=True)
