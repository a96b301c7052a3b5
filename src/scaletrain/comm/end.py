"""How a process leaves its job: stopped on request, done, or failed.

- Stopped: a stop signal (cluster.stop_signals, Ctrl-C) does not kill a process. It sets the
  request bits of its Context (liveness.CHECKPOINT | liveness.STOP); the strategies carry them
  to the next sync point (schedule.py), where every process checkpoints and ends with Stopped
  (`stopped`), whose exit status says so.
- Done: `finish` marks the process done and waits for the others: a barrier, or in a job that
  goes on without lost workers (Context.tolerant) the job's store, where a rank the job dropped
  is not waited for (`store_gather` meets there too).
- Failed: `abort` says in the store who failed, so the others stop at once, naming it.
"""

from __future__ import annotations

import signal
import threading
import time
from contextlib import contextmanager

import torch.distributed as dist

from ..errors import EXIT_STOPPED, Stopped
from ..proc import early
from .groups import Context
from .liveness import CHECKPOINT, STOP, announce, linger, write_note


def stopped(signum: int, where: str) -> Stopped:
    """The error a process ends with after a stop at a sync point: it names the signal
    (signum, -1 when unknown) and its exit status says so (130 for Ctrl-C)."""
    name = signal.Signals(signum).name if signum > 0 else "a stop request"
    return Stopped(f"stopped by {name} {where}", 130 if signum == signal.SIGINT else EXIT_STOPPED)


def finish(ctx: Context) -> None:
    """Mark this process done, wait for all, and leave the world."""
    if not ctx.distributed:
        return
    ctx._finishing.set()
    if ctx.tolerant:  # in the store: a process dropped meanwhile is not waited for
        store = _main_store(ctx)
        store.set(f"done/{ctx.rank}", "1")
        if ctx.rank == 0:  # it serves the store: it leaves last
            _wait_all(ctx, store, "done")
    else:
        dist.barrier()  # untimed: the heartbeats still watch for a peer lost before it gets here
    ctx._stop.set()
    ctx._thread.join()  # the store client is not shared across threads
    try:
        ctx.store.set(f"done/{ctx.rank}", "1")
    except Exception:  # noqa: BLE001 - rank 0, which serves the store, may be gone: all are past the barrier
        pass
    if dist.is_initialized():  # a replacement joined no world (comm/ring.py)
        dist.destroy_process_group()


def store_gather(ctx: Context, key: str, data: bytes) -> dict[int, bytes]:
    """Every process's `data`, on rank 0 (the others get {}), through the store: a rank the job
    went on without is not waited for (the heartbeats watch the others meanwhile)."""
    store = _main_store(ctx)
    store.set(f"{key}/{ctx.rank}", data)
    if ctx.rank != 0:
        return {}
    ranks = _wait_all(ctx, store, key)
    return {r: store.get(f"{key}/{r}") for r in ranks}


def _main_store(ctx: Context):
    """The main thread's own client of the store (the heartbeat thread has the default one)."""
    if ctx._main is None:
        ctx._main = ctx.store.clone()
    return ctx._main


def _wait_all(ctx: Context, store, key: str) -> list[int]:
    """Wait until every rank has set `key/RANK` or was dropped; returns those that set it."""
    while True:
        ranks = [r for r in range(ctx.plan.world_size) if r not in ctx.dropped]
        if all(r == ctx.rank or store.check([f"{key}/{r}"]) for r in ranks):
            return [r for r in ranks if r == ctx.rank or store.check([f"{key}/{r}"])]
        time.sleep(0.05)


def abort(ctx: Context, culprits: list[int] | None = None) -> None:
    """Leave after a failure: say in the store who failed (this process unless `culprits`
    names the peers it lost; those go to the launcher's note too), so the others stop at
    once, then drop the process groups. A replacement not yet admitted (ring.py) says nothing: the job
    went on without its rank and goes on so."""
    if culprits:
        write_note(ctx, culprits)
    ctx._stop.set()
    if ctx._thread is not None:
        ctx._thread.join()  # the store client is the heartbeat's until it ends
    if ctx._thread is not None and not ctx.late:
        announce(ctx.store, ctx.rank, culprits or [ctx.rank])
        linger(ctx)
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - already broken
            pass


def catch_stop_signals(ctx: Context, names: tuple[str, ...], escalate: bool) -> dict:
    """From now on the signals named ask ctx for a checkpoint and a stop (see stop_signals); returns the
    handlers they had."""
    def on_signal(signum, frame):
        if escalate and signum == signal.SIGINT and ctx.requests & STOP:
            raise KeyboardInterrupt
        ctx.stop_signal = ctx.stop_signal or signum
        ctx.requests |= STOP | CHECKPOINT

    sigs = [getattr(signal, n) for n in names]
    before = {s: signal.signal(s, on_signal) for s in sigs}
    came = early.take(before)  # one that came while the process was importing (proc/early.py)
    if came in sigs:
        on_signal(came, None)
    elif came:
        signal.raise_signal(came)  # not a stop signal of this job: what it would have done
    # A launcher may have started this process with them held (launch/local.py): one that came
    # during start-up is acted on now, as a stop at the next sync point.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, sigs)
    return before


@contextmanager
def stop_signals(ctx: Context, names: tuple[str, ...], escalate: bool):
    """While inside: the signals named (cluster.stopping: the job's stop signals and Ctrl-C) ask this
    process for a checkpoint and a stop at the next sync point, instead of killing it. escalate: a
    second Ctrl-C interrupts at once (a process with no launcher above it; a launcher escalates for
    its children)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    before = catch_stop_signals(ctx, names, escalate)
    try:
        yield
    finally:
        for s, h in before.items():
            signal.signal(s, h)
