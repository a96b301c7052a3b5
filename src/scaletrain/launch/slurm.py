"""Slurm: an sbatch script from the plan, the job step that starts every process, and the job's end.

`scaletrain slurm` writes RUN_DIR/config.toml (the resolved config, paths
made absolute) and RUN_DIR/job.sbatch, and with --submit hands it to sbatch,
after the checks of launch/preflight.py. The script asks Slurm for the plan's
nodes and runs `scaletrain train`, which in the batch step (`run_job`)
starts one srun step with every process of the plan. Nodes may run different
numbers of processes (a PS alongside), so the step uses
--distribution=arbitrary with a host file that names, for each global rank in
order, the host of its plan node: task i is rank i, on the node the plan
gives it (each process checks SLURM_NODEID against the plan).

What the script asks of Slurm, and why:
- --nodes, --ntasks-per-node=1, --cpus-per-task=C: one batch slot per node
  holding C CPUs, C the most any plan node needs (proc/cpus.py: a worker's
  loaders and threads, a PS's threads). One step has one --cpus-per-task for
  all its tasks, so CPUs per role cannot be asked task by task; the step asks
  none (srun's -c implies --exact since 21.08, which under cgroups would hold a
  node's step to one CPU a task), so it holds all the job's CPUs on each node,
  its tasks share them unbound (--cpu-bind=none) and each process takes the
  threads `cpus.threads` gives it (`step_layout`).
- --gpus-per-node (unless train.device = "cpu"). With PS on nodes of their
  own it would reserve GPUs there too, so such a job is heterogeneous
  (`#SBATCH hetjob`): a component of worker nodes with GPUs, then one of PS
  nodes without, in the plan's order; its step runs one srun component each.
- --mem or --exclusive when given (neither: the partition's default memory).
- cluster.setup lines (`module load ...`) run in the batch step before
  `scaletrain train`; srun passes the environment they make to every task.
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
- --no-kill, for a job that goes on without a lost process (strategies/traits.tolerant): a
  failed node ends its own tasks, not the allocation; the step has --no-kill too. Each task
  keeps its rank (launch/keep.py): a process it loses is replaced on its node. A rank the
  chief dropped that no keeper answers for (its task or its node gone) is started again by
  `run_job` in a step of its own (keep.start_orphans, srun --overlap), on its host while Slurm
  holds it up, else on a host of the allocation the plan leaves out (a spare), while
  cluster.replacements lasts.

When a task ends, srun gives the others cluster.timeout_s + 5 s to end on
their own, as the local launcher does (their heartbeats see a lost peer in
timeout_s and say which), then kills them. It does not kill them at the first
non-zero status (--kill-on-bad-exit): after a stop at a checkpoint every task
exits 75 a moment apart, and one killed on its way out would turn the step's
status into 137 and lose the requeue.

Signals in the batch step: srun forwards SIGUSR1 to its tasks but answers
SIGTERM by killing the step, with no checkpoint. So `run_job` forwards both
with `scancel --signal=SIG JOB.STEP`, which delivers the signal and nothing
more; it finds its step by the step name it gave srun. A SIGTERM that reaches
srun itself (`scancel --full`; a time limit or a preemption, which signal the
batch step too) still kills the step: srun sets its own handling of the signal
whatever it inherits, so the job's time limit has the warning signal before it.

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

from ..config import Config, dump_toml
from ..device import SETUP_DONE
from ..errors import EXIT_STOPPED
from ..metrics import LAUNCHED
from ..plan import format_table, node_name
from ..strategies import traits
from . import flags, keep
from ..proc import cpus, early, fabric
from ..proc.env import LaunchError, allocation_hosts, het_groups, plan_for, script_env, slurm_hosts, slurm_port
from .follow import job_fields, submit  # noqa: F401 - submit: `scaletrain slurm --submit` calls it here
from .preflight import mem_mb, parts
from .local import check_port, free_port, write_failure
from .notes import read_ranks

WARNING = signal.SIGUSR1  # what --signal=B:USR1 sends before the time limit


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
           account: str = "", warn_before: int = 300, requeue: bool = True, mem: str = "",
           exclusive: bool = False, checked: str = "", env=os.environ, pythonpath: list[str] | None = None,
           warnings: list[str] | None = None) -> str:
    """The sbatch script: the plan's nodes with their CPUs and GPUs, then `scaletrain train` (which,
    in the batch step of an allocation, starts the job step below). checked: what the partition's
    nodes were checked against, or why they were not (a comment line). pythonpath, warnings: the
    directories an import-path network or dataset needs, and what launch/flags.py warns of (found
    here when None)."""
    plan = plan_for(cfg)
    run_dir = run_dir.resolve()
    if pythonpath is None or warnings is None:
        pythonpath, warnings = flags.job_flags(cfg, plan, run_dir, parts(plan, cfg)[0].gpus)
    limit = time_seconds(time) if time else None
    if warn_before < 0:
        raise LaunchError(f"--warn-before {warn_before}: give seconds >= 0 (0 = no warning)")
    if warn_before and WARNING.name not in cfg.cluster.stopping:
        raise LaunchError(f"cluster.stop_signals = {cfg.cluster.stop_signals!r} lacks {WARNING.name}, the warning "
                          f"signal of --warn-before: add it, or give --warn-before 0")
    if warn_before and limit is not None and warn_before >= limit:
        raise LaunchError(f"--warn-before {warn_before} s is not shorter than --time {time} ({limit} s): the job "
                          f"would be told to stop as it starts; give --warn-before below {limit} (0 = no warning)")
    if mem:
        mem_mb(mem)  # a size Slurm reads, or one line now
    job = [f"--job-name=scaletrain-{run_dir.name}", f"--output={run_dir}/logs/slurm-%j.out", "--open-mode=append",
           "--requeue" if requeue else "--no-requeue"]
    job += [f"--signal=B:{WARNING.name[3:]}@{warn_before}"] if warn_before else []
    job += ["--no-kill"] if traits.tolerant(cfg) else []  # a failed node does not end a job that goes on without it
    where = [f"--{k}={v}" for k, v in (("partition", partition), ("time", time), ("account", account)) if v]
    where += ([f"--mem={mem}"] if mem else []) + (["--exclusive"] if exclusive else [])
    components = parts(plan, cfg)
    sbatch = []
    for k, part in enumerate(components):
        sbatch += ["hetjob"] if k else job
        sbatch += [f"--nodes={part.nodes}", "--ntasks-per-node=1", f"--cpus-per-task={part.cpus}"]
        sbatch += [f"--gpus-per-node={part.gpus}"] if part.gpus else []
        sbatch += where
    needs = [n for part in components for n in part.needs]
    cmd = [sys.executable, "-m", "scaletrain", "train", *train_args, "--run-dir", str(run_dir)]
    placement = format_table(plan).splitlines()[: plan.nodes_total + 1]
    return "\n".join([
        "#!/bin/bash", *(f"#SBATCH {o}" for o in sbatch),
        "# Written by scaletrain. CPUs a node (proc/cpus.py): a worker's loaders and threads, a PS's threads",
        "# (it also takes what its node's workers leave); the job step holds every CPU the job has on a node,",
        "# which the node's processes share unbound.",
        *(f"#   {node_name(n.node)}: {n.words()} = {n.cpus} CPUs" for n in needs),
        *([f"# {checked}"] if checked else []),
        *(f"# Warning: {w}" for w in warnings),
        *(["# GPUs on worker nodes only: the PS nodes are a second component (hetjob) with none."]
          if len(components) > 1 else []),
        *([] if mem or exclusive else ["# Memory: the partition's default (give --mem or --exclusive to choose)."]),
        f"# {network_words(cfg.cluster.ifname, env)}",
        "# The placement (`scaletrain plan`):",
        *(f"#   {line}" for line in placement),
        "# Every process finds its role from SLURM_PROCID, SLURM_NODEID and the plan.",
        "# A requeued run (SLURM_RESTART_COUNT set) continues from the newest checkpoint.",
        *(["# Set-up (cluster.setup, --setup): runs in the batch step; srun passes the environment it makes "
           "to every task.", *cfg.cluster.setup, f"export {SETUP_DONE}=1"] if cfg.cluster.setup else []),
        *(["# Where model.name's or data.name's module imports from (srun passes it to every task):",
           f"export PYTHONPATH={shlex.quote(os.pathsep.join(pythonpath))}${{PYTHONPATH:+{os.pathsep}$PYTHONPATH}}"]
          if pythonpath else []),
        f"mkdir -p {shlex.quote(str(run_dir / 'logs'))}",
        "exec " + shlex.join(cmd) + " ${SLURM_RESTART_COUNT:+--resume}", ""])


def network_words(ifname: str, env=os.environ) -> str:
    """Which interface gloo's and NCCL's sockets will use on the job's nodes (proc/fabric.py)."""
    given = [f"{k}={env[k]}" for k in fabric.ENV_KEYS if k in env]
    if given:  # sbatch passes the submitting shell's environment on (--export=ALL)
        return f"Network: {', '.join(given)} from the shell that wrote this; it wins over cluster.ifname on every node."
    if ifname:
        return (f"Network: gloo and NCCL sockets on {ifname} (cluster.ifname); a node without it stops the job "
                f"with a line naming the node.")
    return ("Network: gloo and NCCL sockets on each node's ib* interface if it has one, else its host name's "
            "(cluster.ifname names one).")


def write(cfg: Config, run_dir: Path, resume: bool = False, **opts) -> Path:
    """RUN_DIR/config.toml (the resolved config, which the job reads) and RUN_DIR/job.sbatch."""
    args = ["--recipe", str((run_dir / "config.toml").resolve())] + (["--resume"] if resume else [])
    text = script(cfg, run_dir, args, **opts)  # a refusal leaves nothing written
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(dump_toml(cfg))
    path = run_dir / "job.sbatch"
    path.write_text(text)
    return path


def run_job(cfg: Config, run_dir: Path, resume: bool = False, progress: bool = True, exclude=(),
            script: list[str] | None = None) -> int:
    """Inside an allocation: start every process of the plan with one srun step, pass SIGTERM and
    the warning signal on to every task, and requeue the job when the warning stopped it.
    exclude: hosts of the allocation left out (a failed node, see launch/supervise.py). script: a
    user's script and its arguments, which every task runs (job.Job.from_env), instead of the
    built-in loop."""
    plan = plan_for(cfg)
    job = os.environ.get("SLURM_JOB_ID", "0")
    hosts = slurm_hosts(plan, os.environ, exclude)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    for note in [*(run_dir / "logs").glob("rank*.lost"), *(run_dir / "logs").glob("exited-*"),
                 *(run_dir / "logs").glob("kept-*"), *(run_dir / "logs").glob(f"replacement-slurm-{job}-*"),
                 run_dir / "logs" / "dropped",
                 run_dir / "logs" / "exited"]:  # an earlier attempt's (exited: a local launcher's; launch/keep.py)
        note.unlink(missing_ok=True)
    (run_dir / "config.toml").write_text(dump_toml(cfg))  # what every process of the step reads
    hostfile = run_dir / "logs" / f"hosts-{job}.txt"
    hostfile.write_text("".join(f"{hosts[p.node]}\n" for p in plan.procs))
    port = rendezvous_port(cfg, job, hosts[0], os.environ)
    threads = cpus.threads(plan, cfg, node_cpus(os.environ, hosts))
    print(f"Slurm job {job}: {plan.world_size} processes on {', '.join(hosts[:plan.nodes_total])}; "
          f"rendezvous {hosts[0]}:{port}; threads by rank {','.join(map(str, threads))}", flush=True)
    name = f"scaletrain-{job}-{os.getpid()}"  # how the signal forwarder finds this step
    # After a task ends, srun waits that long for the others: the heartbeats' bound, or for ever in a
    # job that goes on without a lost worker node (its processes end on their own; comm/liveness.py).
    tolerant = traits.tolerant(cfg)
    # --no-kill: a failed node ends its tasks, not the step (the job goes on without it)
    cmd = ["srun", f"--job-name={name}", "--kill-on-bad-exit=0",
           f"--wait={0 if tolerant else int(cfg.cluster.timeout_s) + 5}", *(["--no-kill"] if tolerant else [])]
    het = len(het_groups(os.environ)) > 1
    cmd += step_layout(plan, cfg, het)
    if script:
        task = [sys.executable, *script]
    else:
        # a task of a job that goes on without a lost process keeps its rank (keep.py), loading no torch
        task = [sys.executable, "-m", f"scaletrain.launch.{'keep' if tolerant else 'entry'}", str(run_dir)]
        task += (["--resume"] if resume else []) + ([] if progress else ["--quiet"])
    cmd += task
    env = step_env(os.environ)
    env.update(SCALETRAIN_THREADS=",".join(map(str, threads)), SCALETRAIN_PORT=str(port),
               **{LAUNCHED: str(time.time())}, **(script_env(run_dir, resume) if script else {}))
    if not het:  # srun takes a host file's hosts as every component's node list
        env.update(SLURM_HOSTFILE=str(hostfile))
    step: list[subprocess.Popen] = []  # the job's step, then any step of replacements (keep.start_orphans)
    got: list[int] = []
    started = time.time()
    orphans = keep.Orphans(run_dir) if tolerant and cfg.cluster.replacements else None
    spares = hosts[plan.nodes_total:]  # hosts of the allocation the plan leaves out

    def forward(sig, _frame):
        got.append(sig)
        if step:
            forward_signal(job, name, sig, step[0])

    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, WARNING)}
    came = early.take(old)  # held until these handlers (proc/early.py): passed on as srun starts
    got += [came] if came else []
    try:
        step.append(subprocess.Popen(cmd, env=env))
        for sig in got:  # arrived while srun was starting
            forward_signal(job, name, sig, step[0])
        while (rc := step[0].poll()) is None:
            if orphans is not None and not got:
                step += keep.start_orphans(orphans.poll(), plan, cfg, hosts, spares, run_dir, job,
                                      ["srun", f"--job-name={name}", "--kill-on-bad-exit=0", "--overlap",
                                       "--cpu-bind=none", *task], env)
            time.sleep(0.5)
        for extra in step[1:]:  # replacements end with the job, at its final barrier
            try:
                extra.wait(cfg.cluster.timeout_s + 60)
            except subprocess.TimeoutExpired:  # a step Slurm never started, or a process stuck: ended below
                print(f"scaletrain: a step of replacements still ran {cfg.cluster.timeout_s + 60:.0f} s after the "
                      "job's end: cancelled", file=sys.stderr, flush=True)
                break
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        for p in step:
            if p.poll() is None:  # never leave a step behind this process
                p.terminate()  # srun kills the step's tasks on SIGTERM
                try:
                    p.wait(60)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
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


def rendezvous_port(cfg: Config, job: str, host: str, env) -> int:
    """The port of the job's rendezvous on `host`, the first of the step: cluster.master_port, or
    one from the job id (env.slurm_port). The batch step runs on that host (the allocation's
    first), so the port is checked here, before any task starts, as the local launcher does: a
    busy cluster.master_port is one line naming it (LaunchError, status 2), and a busy port from
    the job id gives way to a free one. Rank 0 would otherwise fail alone, and srun kill the
    others once cluster.timeout_s had passed. Unchecked where the rendezvous is on another host."""
    port = cfg.cluster.master_port or slurm_port(job)
    if env.get("SLURMD_NODENAME") != host:
        return port
    try:
        check_port("", port, host)
    except LaunchError:
        if cfg.cluster.master_port:
            raise
        return free_port("")
    return port


def node_cpus(env, hosts: list[str]) -> list[int]:
    """CPUs Slurm gave the job on each of `hosts` (SLURM_JOB_CPUS_PER_NODE, per component)."""
    counts = [c for g in het_groups(env) for c in cpus.expand_counts(env.get(f"SLURM_JOB_CPUS_PER_NODE{g}", ""))]
    given = dict(zip(allocation_hosts(env), counts))
    missing = [h for h in hosts if h not in given]
    if missing:
        raise LaunchError(f"SLURM_JOB_CPUS_PER_NODE does not say how many CPUs {missing[0]} has for this job")
    return [given[h] for h in hosts]


# What the batch step's environment says of its own slot (one task a node, the node's CPUs), which
# srun would take as the step's: a task count a node, or a CPU count a task (Slurm 21.08 reads
# SLURM_CPUS_PER_TASK, 22.05 SRUN_CPUS_PER_TASK, later ones SLURM_TRES_PER_TASK), which implies --exact.
BATCH_SLOT = ("SLURM_NTASKS_PER_NODE", "SLURM_CPUS_PER_TASK", "SRUN_CPUS_PER_TASK", "SLURM_TRES_PER_TASK",
              "SLURM_EXACT")


def step_env(env) -> dict[str, str]:
    """The environment srun starts the step with: the batch step's, less what describes its slot."""
    return {k: v for k, v in env.items() if not k.startswith(BATCH_SLOT)}


def step_layout(plan, cfg, het: bool) -> list[str]:
    """srun's options that put every process of the plan where the plan says. The step asks no CPU
    count: srun's -c implies --exact (Slurm >= 21.08), and under cgroups (ConstrainCores) or task
    binding an exact step holds one CPU a task on its node, a worker's loaders and a PS squeezed onto
    them. Without it the step holds every CPU the job has on each of its nodes (what the script asked:
    the plan node's need, proc/cpus.py), and --cpu-bind=none leaves the node's processes free to
    share them, each taking its thread count from SCALETRAIN_THREADS. A heterogeneous job (PS nodes
    without GPUs, after the worker nodes) runs a component each, ranks in component order, so no host
    file is needed."""
    each = ["--cpu-bind=none"]
    if not het:
        return [f"--ntasks={plan.world_size}", f"--nodes={plan.nodes_total}", "--distribution=arbitrary", *each]
    layout = []
    for k, part in enumerate(parts(plan, cfg)):
        procs = [p for n in part.needs for p in plan.on_node(n.node)]
        per_node = len(procs) // part.nodes
        layout += ([":"] if k else []) + [f"--ntasks={len(procs)}", f"--nodes={part.nodes}",
                                          f"--ntasks-per-node={per_node}", *each]
    return layout


def _name_culprit(run_dir: Path, plan) -> None:
    """logs/failure.json for run.py: the process most of the others left because of (their
    rankR.lost notes, comm.liveness.write_note), with the host it ran on."""
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
        for i in ids:  # the job's step and any of replacements; scancel fails only for a step that is ending
            subprocess.run(["scancel", f"--signal={sig_name}", i], capture_output=True)
        if ids:
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
