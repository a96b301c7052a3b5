"""A job process's start and end, whatever it runs: join the job, take a role, and end as the others
need to hear it.

entry.py (the built-in loop) and job.Job.from_env (a user's script) both call them: `join` finds
this process's rank and the rendezvous, places it on its GPU, forms the process groups and has stop
signals ask for a checkpoint; a parameter server's process then serves its shard (`serve`). `ending`
maps how the work ended to the exit status and tells the peers: a clean end meets them at the final
barrier, a failure stops them at once, naming a lost peer where that was the cause.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
from pathlib import Path

import torch

from .. import stats
from ..comm import end, groups, liveness
from ..comm.groups import Context
from ..comm.ring import Finished
from ..device import facts
from ..errors import EXIT_PEER, USER_ERRORS, ConfigError, PlanError, Stopped
from ..metrics import start_up
from ..ps.server import run_shard
from ..proc import env as launch_env, fabric
from ..proc.env import LaunchError, Rendezvous
from . import keep


def join(cfg, run_dir: Path, progress: bool, node: int | None = None) -> Context | int:
    """Be one process of the job: find its rank and the rendezvous, join. Returns the job's Context,
    or the exit status of a process that could not join (the reason printed)."""
    found = keep.placed(cfg, node)
    if isinstance(found, int):
        return found
    plan, rdzv = found
    rank = rdzv.rank
    try:
        if plan.procs[rank].role == "worker":  # its GPUs, on this host (a PS uses none: its host may have none)
            plan = launch_env.plan_for(cfg, facts())
    except PlanError as e:
        record(run_dir, plan, rdzv)  # where it was to run, for the operator
        host = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        print(f"scaletrain: error: {plan.describe(rank)} on {host}: {e}", file=sys.stderr, flush=True)
        return 2
    given = launcher_threads(os.environ.get("SCALETRAIN_THREADS", ""), rank)
    if given and plan.procs[rank].role == "ps":  # train.threads is a worker's; a PS takes its budget's
        torch.set_num_threads(given)
    elif not cfg.train.threads:  # one thread where no launcher says (torchrun): many processes share a node
        torch.set_num_threads(given or 1)
    record(run_dir, plan, rdzv)
    if plan.procs[rank].device.startswith("cuda"):
        # Before any process group: NCCL's communicators, the caching allocator and every kernel of
        # this process on its own GPU, never GPU 0 by default.
        torch.cuda.set_device(plan.procs[rank].device)
    note = str(run_dir / "logs" / f"rank{rank}.lost")
    try:
        ctx = groups.init(cfg, plan, rdzv)
    except (groups.PeerLost, groups.PortInUse, LaunchError) as e:
        print(f"scaletrain: error: {plan.describe(rank)}: {e}", file=sys.stderr, flush=True)
        if getattr(e, "culprits", None):  # it failed because of them: the launcher names them
            liveness.note_ranks(note, e.culprits)
            return EXIT_PEER
        return 1
    ctx.note = note
    if progress and ctx.is_chief:
        print(start_up("process groups ready"), flush=True)
    # Kept to the process's exit: a stop signal can come more than once (under Slurm a worker got the
    # warning signal again in its last barrier, after the checkpoint, and died of it), and none kills it.
    # The workers decide when to stop; a PS shard's request reaches them through its replies.
    end.catch_stop_signals(ctx, cfg.cluster.stopping, escalate=False)
    return ctx


def serve(cfg, ctx: Context, run_dir: Path, resume: bool) -> None:
    """A parameter server's process: serve its shard until the job ends, then give its figures."""
    figures = run_shard(cfg, ctx, run_dir, resume)
    stopped, step = figures.pop("stopped"), figures.pop("step")
    stats.gather(ctx, figures)
    if stopped:
        raise end.stopped(stopped, f"at step {step}")


def ending(ctx: Context, exc: BaseException | None) -> int:
    """The exit status of a process whose work ended with `exc` (None: done), after telling the
    peers: the final barrier, or an abort that stops them at once. An error that is no one's fault
    known here (a bug, a traceback) is re-raised after the abort, for this rank's log."""
    rank = ctx.rank
    if exc is None:
        end.finish(ctx)
        return 0
    if isinstance(exc, Stopped):  # every process stopped at the same sync point, after the checkpoint
        logging.getLogger("scaletrain").info("%s: %s", ctx.describe(rank), exc)
        end.finish(ctx)
        return exc.status
    if isinstance(exc, (*USER_ERRORS, ConfigError)):  # ConfigError: a user's module that fails here
        print(f"scaletrain: error: {ctx.describe(rank)}: {exc}", file=sys.stderr, flush=True)
        end.abort(ctx)
        return 2 if isinstance(exc, ConfigError) and not isinstance(exc, USER_ERRORS) else 1
    if isinstance(exc, Finished):  # a replacement the job ended without admitting (comm/ring.py)
        print(f"scaletrain: {ctx.describe(rank)}: the job reached its end before this replacement joined",
              file=sys.stderr, flush=True)
        return 0
    if isinstance(exc, KeyboardInterrupt):
        end.abort(ctx)
        return 130
    lost = ctx.lost(exc) if isinstance(exc, Exception) else None
    if lost is None:
        end.abort(ctx)  # the peers stop at once; the traceback goes to this rank's log
        raise exc
    print(f"scaletrain: error: {lost}", file=sys.stderr, flush=True)
    end.abort(ctx, culprits=ctx.gone)
    return EXIT_PEER


def join_or_exit(cfg, run_dir: Path, resume: bool, progress: bool, node: int | None) -> Context:
    """join() for a process that runs the user's loop: a process that could not join exits with its
    status, and a parameter server's serves its shard and exits; a worker gets its Context."""
    if keep.wanted(cfg):  # under torchrun or srun, a job that goes on without a lost process: keep the rank
        exit_now(keep.kept(cfg, run_dir, node))
    ctx = join(cfg, run_dir, progress, node)
    if isinstance(ctx, int):
        exit_now(ctx)
    if ctx.me.role == "ps":
        try:
            serve(cfg, ctx, run_dir, resume)
        except BaseException as e:  # noqa: BLE001 - mapped to the process's exit status
            exit_now(ending(ctx, e))
        exit_now(ending(ctx, None))
    return ctx


def end_or_exit(ctx: Context, exc: BaseException | None) -> None:
    """ending() for a process that runs the user's loop: returns after a clean end, so that the script
    goes on; exits with the status otherwise (a stop, an error said in one line, a lost peer)."""
    try:
        rc = ending(ctx, exc)
    except BaseException:  # noqa: BLE001 - the traceback, as the interpreter would print it, then status 1
        if exc is None:
            raise
        sys.excepthook(type(exc), exc, exc.__traceback__)
        exit_now(1)
    if rc:
        exit_now(rc)


def launcher_threads(text: str, rank: int) -> int:
    """This process's torch threads as its launcher gives them: one count for every process (the
    local launcher) or one by rank, comma-separated (Slurm: proc/cpus.py). 0 = none given."""
    counts = [int(t) for t in text.split(",") if t.strip().isdigit()]
    if len(counts) > 1:
        return counts[rank] if rank < len(counts) else 0
    return counts[0] if counts else 0


def record(run_dir: Path, plan, rdzv: Rendezvous) -> None:
    """logs/rankR.json: where this process runs, for operators and tests."""
    p = plan.procs[rdzv.rank]
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    tmp = run_dir / "logs" / f".rank{rdzv.rank}.json.tmp"
    tmp.write_text(json.dumps({
        "rank": rdzv.rank, "role": p.role, "index": p.index, "node": p.node, "local_rank": p.local_rank,
        "device": p.device, "pid": os.getpid(), "host": socket.gethostname(), "launcher": rdzv.launcher,
        "job": rdzv.job, "rendezvous": f"{rdzv.addr}:{rdzv.port}", "threads": torch.get_num_threads(),
        "cpus_allowed": sorted(os.sched_getaffinity(0)),  # what a scheduler's cgroup or binding left it
        "net_namespace": os.stat("/proc/self/ns/net").st_ino,  # one per node in the cluster twin
        "addresses": fabric.interfaces(),
        **{k: os.environ[k] for k in ("SLURMD_NODENAME", "SLURM_NODEID", "SLURM_LOCALID", "SLURM_STEP_GPUS",
                                      "GROUP_RANK", "LOCAL_RANK")
           if k in os.environ}}) + "\n")
    os.replace(tmp, run_dir / "logs" / f"rank{rdzv.rank}.json")  # readers never see half a file


def exit_now(rc: int) -> None:
    """End a job process once its work and the final barrier are done. The process
    skips interpreter teardown: C++ threads of the communication libraries being
    destroyed then have aborted finished processes (SIGABRT) now and then."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(rc)
