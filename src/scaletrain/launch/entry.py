"""What every process of a distributed job runs: join, take a role, work, report.

`python -m scaletrain.launch.entry RUN_DIR` runs it with the resolved config
in RUN_DIR/config.toml (the local launcher and Slurm jobs start it so);
`scaletrain train` under torchrun or srun calls `run` with the recipe's.
The process's rank and the job's rendezvous come from the launcher's
environment (launch/env.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
from pathlib import Path

import torch

from .. import stats
from ..comm import end, groups, liveness
from ..config import load_config
from ..device import facts
from ..errors import EXIT_PEER, USER_ERRORS, ConfigError, PlanError, Stopped
from ..metrics import start_up
from ..ps.server import run_shard
from ..train import train
from . import env as launch_env
from .env import LaunchError, Rendezvous


def run(cfg, run_dir: Path, resume: bool, progress: bool, node: int | None = None) -> int:
    """Be one process of the job: find its rank and the rendezvous, join, work, report. Returns the
    exit status."""
    try:
        plan = launch_env.plan_for(cfg)
        rdzv = launch_env.rendezvous(plan, cfg.cluster.master_addr, cfg.cluster.master_port, node)
    except (LaunchError, PlanError) as e:
        print(f"scaletrain: error: {e}", file=sys.stderr, flush=True)
        return 2
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
    try:
        if ctx.me.role == "ps":
            figures = run_shard(cfg, ctx, run_dir, resume)
            stopped, step = figures.pop("stopped"), figures.pop("step")
            stats.gather(ctx, figures)
            if stopped:
                raise end.stopped(stopped, f"at step {step}")
        else:
            train(cfg, run_dir, resume=resume, progress=progress, ctx=ctx)
    except Stopped as e:  # every process stopped at the same sync point, after the checkpoint
        logging.getLogger("scaletrain").info("%s: %s", ctx.describe(rank), e)
        end.finish(ctx)
        return e.status
    except USER_ERRORS as e:
        print(f"scaletrain: error: {ctx.describe(rank)}: {e}", file=sys.stderr, flush=True)
        end.abort(ctx)
        return 1
    except ConfigError as e:  # a user's dataset that does not import or build here (data/user.py)
        print(f"scaletrain: error: {ctx.describe(rank)}: {e}", file=sys.stderr, flush=True)
        end.abort(ctx)
        return 2
    except KeyboardInterrupt:
        end.abort(ctx)
        return 130
    except Exception as e:  # noqa: BLE001 - a lost peer's error becomes one line naming it
        lost = ctx.lost(e)
        if lost is None:
            end.abort(ctx)  # the peers stop at once; the traceback below goes to this rank's log
            raise
        print(f"scaletrain: error: {lost}", file=sys.stderr, flush=True)
        end.abort(ctx, culprits=ctx.gone)
        return EXIT_PEER
    end.finish(ctx)
    return 0


def launcher_threads(text: str, rank: int) -> int:
    """This process's torch threads as its launcher gives them: one count for every process (the
    local launcher) or one by rank, comma-separated (Slurm: launch/cpus.py). 0 = none given."""
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
        **{k: os.environ[k] for k in ("SLURMD_NODENAME", "SLURM_NODEID", "SLURM_LOCALID", "SLURM_STEP_GPUS",
                                      "GROUP_RANK", "LOCAL_RANK")
           if k in os.environ}}) + "\n")
    os.replace(tmp, run_dir / "logs" / f"rank{rdzv.rank}.json")  # readers never see half a file


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scaletrain.launch.entry")
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--quiet", action="store_true")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    return run(load_config(a.run_dir / "config.toml"), a.run_dir, a.resume, not a.quiet)


def exit_now(rc: int) -> None:
    """End a job process once its work and the final barrier are done. The process
    skips interpreter teardown: C++ threads of the communication libraries being
    destroyed then have aborted finished processes (SIGABRT) now and then."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(rc)


if __name__ == "__main__":
    exit_now(main())
