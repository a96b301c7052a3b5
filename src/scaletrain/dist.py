"""Process groups, liveness and failure reports. Nothing happens at import time.

Every process joins one gloo world (PS traffic and small collectives on CPU
tensors), then makes the same subgroups in the same order: one per worker
node (the replicas that average inside the node; NCCL on GPUs) and one of all
workers (all-reduce).

Liveness is not a time limit on work. Collectives and receives wait as long
as a healthy peer needs (an evaluation, a checkpoint to a slow file system,
a data scan): their timeout is OPERATION_TIMEOUT, days (point-to-point
operations go through send/recv/wait here for that). A heartbeat thread
in every process increments the counter `hb/RANK` in the rendezvous store
and reads everyone's; a peer whose counter has not moved for STALE_S + 
cluster.timeout_s of the reader's own clock is dead or frozen, and the
reader exits naming it, so no process waits forever on a lost one. Counters,
not timestamps: the hosts' clocks are never compared. A process that fails
says so in the store (`failed/RANK`, `abort`): its peers exit at once, naming
it, instead of waiting out the timeout.

Requests: a stop signal (cluster.stop_signals, Ctrl-C) sets bits in
`Context.requests` of the process that got it; the heartbeat thread puts a
stop in the store (`stop`) and copies one found there into its own process,
so a signal sent to any one process reaches all of them within a heartbeat
or two. The strategies carry the bits to an agreed step (train.py).

A lost worker node the strategy trains on without (`Context.tolerate`,
strategies.survivable: asynchronous PS modes, never the chief's node) is
dropped instead of ending the job. Only the chief declares: once such ranks
were silent for cluster.timeout_s, its heartbeat thread tells the shards
(`Context.on_drop`), then lists them in the store (`lost`) and in
RUN_DIR/logs/dropped (for the launcher, which kills them if still there).
Every heartbeat thread reads the list into `Context.dropped` and stops
waiting for those ranks; a process that finds itself there (frozen, then
woken) exits. No collective joins the workers of such a job after start-up
(`Context.tolerant`): its points meet at the shards, and its end meets in the
store (`store_gather`, `finish`), where a dropped rank is not waited for.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import signal
import socket
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

import torch.distributed as dist

from .config import Config
from .errors import EXIT_STOPPED, Stopped
from .plan import Plan, Proc, make_plan

log = logging.getLogger("scaletrain")
HEARTBEAT_S = 0.5
STALE_S = 3.0  # a counter still this long marks its rank as missing
OPERATION_TIMEOUT = datetime.timedelta(days=7)  # a healthy collective or receive: no limit below hours
CHECKPOINT, STOP = 1, 2  # request bits: checkpoint at the next agreed step; stop there after it
EXIT_PEER = 3  # exit status of a process that left because a peer failed or went silent


class PeerLost(RuntimeError):
    """A peer died or stopped answering; str() names it."""


class PortInUse(RuntimeError):
    """The rendezvous port is taken; str() names it."""


@dataclass
class Context:
    """Where this process sits in the plan, and its process groups."""

    plan: Plan
    me: Proc
    timeout_s: float = 60.0
    node_group: object = None     # workers of this node (None when alone)
    workers_group: object = None  # all workers (None when alone)
    gone: list[int] = field(default_factory=list)  # ranks seen missing by the heartbeat thread
    requests: int = 0  # CHECKPOINT | STOP bits asked of this process and not yet agreed
    stop_signal: int = 0  # the number of the signal that asked for the stop (-1: heard of, not which)
    note: str = ""  # file where this process writes the ranks it left because of (for its launcher)
    tolerant: bool = False  # the strategy trains on without lost worker nodes (see the module doc)
    survivable: Callable[[set], bool] = lambda lost: False  # whether the job goes on without these ranks
    lost_with: Callable[[int], list] = lambda rank: [rank]  # the ranks lost with one (its node's workers)
    on_drop: Callable[[list], None] | None = None  # the chief's heartbeat thread, before declaring ranks lost
    dropped: list[int] = field(default_factory=list)  # ranks declared lost; the job goes on without them
    dropped_at: list = field(default_factory=list)  # chief: (ranks, time.perf_counter()) of each declaration
    _stop: threading.Event = field(default_factory=threading.Event)
    _finishing: threading.Event = field(default_factory=threading.Event)  # in the final barrier: rank 0 may leave
    _thread: threading.Thread | None = None
    _main: object = None  # the main thread's store client (store_gather, finish)

    @property
    def rank(self) -> int:
        return self.me.rank

    @property
    def is_chief(self) -> bool:
        return self.me.role == "worker" and self.me.index == 0

    @property
    def distributed(self) -> bool:
        return self.plan.world_size > 1

    def describe(self, rank: int) -> str:
        return self.plan.describe(rank)

    def tolerate(self, ranks) -> bool:
        """Whether the job goes on without `ranks` (with their nodes), besides those dropped."""
        return self.survivable(set(self.dropped).union(*(self.lost_with(r) for r in ranks)))

    def node_workers(self) -> list[int]:
        return [p.rank for p in self.plan.workers if p.node == self.me.node]

    def lost(self, err: BaseException) -> PeerLost | None:
        """The error naming the missing peers, or None when every peer is alive
        (then `err` is not a lost peer's doing)."""
        if not self.distributed:
            return None
        deadline = time.monotonic() + STALE_S + 2
        while not self.gone and time.monotonic() < deadline:  # a dead peer's heartbeat needs a moment to age
            time.sleep(HEARTBEAT_S)
        if not self.gone:
            return None
        who = ", ".join(self.describe(r) for r in self.gone)
        log.debug("the operation that failed: %s", err)  # gloo's own words stay out of the user's line
        return PeerLost(f"{self.describe(self.rank)}: lost contact with {who}")


def _store():
    return dist.distributed_c10d._get_default_store()


def single() -> Context:
    from .config import ClusterConfig

    plan = make_plan(ClusterConfig(), ps_required=False)
    return Context(plan, plan.procs[0])


def init(cfg: Config, plan: Plan, seat) -> Context:
    """Join the job's world and make the subgroups; start heartbeat and watchdog."""
    c = cfg.cluster
    timeout = datetime.timedelta(seconds=c.timeout_s)  # the rendezvous: every process starts at once
    loopback = seat.launcher == "local" and _is_loopback(seat.addr)
    if loopback:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo's own sockets on loopback too
    try:
        if seat.launcher == "torchrun":  # torchrun's agent already hosts a store for this job
            dist.init_process_group("gloo", init_method="env://", rank=seat.rank, world_size=seat.world,
                                    timeout=timeout)
        else:
            # Keys under the job's id: a process of another job that reaches this store never meets ours.
            store = dist.PrefixStore(f"scaletrain/{seat.job}", _rendezvous(seat, timeout, loopback))
            dist.init_process_group("gloo", store=store, rank=seat.rank, world_size=seat.world, timeout=timeout)
    except PortInUse:
        raise
    except (RuntimeError, TimeoutError) as e:
        raise _no_rendezvous(seat, timeout, e) from None
    from . import strategies

    ctx = Context(plan, plan.procs[seat.rank], c.timeout_s, tolerant=strategies.tolerant(cfg),
                  survivable=lambda lost: strategies.survivable(cfg, plan, lost),
                  lost_with=lambda rank: strategies.lost_with(plan, rank))
    local_backend = "nccl" if plan.procs[0].device.startswith("cuda") else "gloo"
    # Collective: every rank creates every group, in the same order.
    groups = []
    for node in range(plan.worker_nodes):
        ranks = [p.rank for p in plan.workers if p.node == node]
        g = dist.new_group(ranks, timeout=timeout, backend=local_backend)
        groups.append(g)
        if ctx.me.node == node and ctx.me.role == "worker" and len(ranks) > 1:
            ctx.node_group = g
    g = dist.new_group([p.rank for p in plan.workers], timeout=timeout, backend=local_backend)
    groups.append(g)
    if ctx.me.role == "worker" and len(plan.workers) > 1:
        ctx.workers_group = g
    # Joined: from now on an operation waits as long as a healthy peer works; the heartbeats judge liveness.
    for g in [None] + [g for g in groups if not dist.distributed_c10d._rank_not_in_group(g)]:
        dist.distributed_c10d._set_pg_timeout(OPERATION_TIMEOUT, g)
    ctx._thread = threading.Thread(target=_heartbeat, args=(ctx,), daemon=True, name="heartbeat")
    ctx._thread.start()
    return ctx


def wait(work) -> None:
    """Wait for a point-to-point operation as long as the peer needs: gloo's sends and receives
    keep the rendezvous timeout they were made with unless told otherwise."""
    work.wait(OPERATION_TIMEOUT)


def send(t, dst: int, tag: int) -> None:
    wait(dist.isend(t, dst=dst, tag=tag))


def recv(t, src: int | None = None, tag: int = 0) -> int:
    """Receive into `t` (from any rank when src is None); returns the sender's rank."""
    work = dist.irecv(t, src=src, tag=tag)
    wait(work)
    return work._source_rank() if src is None else src


def _no_rendezvous(seat, timeout: datetime.timedelta, err: BaseException) -> PeerLost:
    return PeerLost(f"no rendezvous for job {seat.job} at {seat.addr}:{seat.port}: the job's {seat.world} "
                    f"processes did not all join within {timeout.total_seconds():.0f} s "
                    f"({str(err).strip().splitlines()[-1]})")


def _is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(addr)).is_loopback
    except (OSError, ValueError):
        return False


def _rendezvous(seat, timeout: datetime.timedelta, loopback: bool):
    """The job's TCPStore: the others connect to rank 0, which serves it on a socket
    of its own, bound to loopback for local jobs and to every interface otherwise."""
    if seat.rank != 0:
        return dist.TCPStore(seat.addr, seat.port, seat.world, False, timeout)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(("127.0.0.1" if loopback else "", seat.port))
        sock.listen(1024)
    except OSError as e:
        sock.close()
        raise PortInUse(f"cannot listen on port {seat.port} for the rendezvous ({e.strerror}); "
                        "set cluster.master_port to a free port") from None
    # The store takes the socket over (and closes it when it ends).
    return dist.TCPStore(seat.addr, seat.port, seat.world, True, timeout, wait_for_workers=False,
                         master_listen_fd=sock.detach())


class _Liveness:
    """When each peer's heartbeat counter last moved, on this process's monotonic clock."""

    def __init__(self, ctx: Context) -> None:
        self.ctx, self.keys = ctx, [f"hb/{r}" for r in range(ctx.plan.world_size)]
        now = time.monotonic()
        self.seen = {r: (None, now) for r in range(ctx.plan.world_size) if r != ctx.rank}

    def missing(self, store) -> list[int]:
        """Peers whose counter stood still for STALE_S and which did not finish cleanly."""
        now, out = time.monotonic(), []
        for r in self.seen:
            value = store.add(self.keys[r], 0)  # reads the counter without waiting for the key
            last, since = self.seen[r]
            if value != last:
                self.seen[r] = (value, now)
            elif now - since > STALE_S and not store.check([f"done/{r}"]):
                out.append(r)
        return out


def _heartbeat(ctx: Context) -> None:
    """The only user of the store after start-up (store clients are not shared across threads)."""
    store, lost_since, failures = _store(), None, 0
    live = _Liveness(ctx)
    while not ctx._stop.wait(HEARTBEAT_S):
        try:
            store.add(f"hb/{ctx.rank}", 1)
            _share_stop(ctx, store)
            _read_dropped(ctx, store, live)
            announced = store.add("failed", 0)  # reads the counter
            if announced > failures:  # a peer announced its failure: no need to wait it out
                failures = announced
                failed = _failed(ctx, store)
                if not ctx.tolerate(failed + _announcers(ctx, store)):  # else the chief declares them
                    _leave(ctx, store, failed, "failed")
            gone = [r for r in live.missing(store) if r not in ctx.dropped]
        except Exception:  # noqa: BLE001 - the store lives in rank 0: it is gone
            # Rank 0 may have left because of a peer already seen missing: name that one first.
            gone = ctx.gone + [0] if 0 not in ctx.gone else ctx.gone
            if not ctx._finishing.is_set():  # a closed connection is no frozen peer: nothing to wait for
                _leave(ctx, None, gone, "left (the rendezvous store closed)")
            store = None
        ctx.gone = gone
        if not gone:
            lost_since = None
            continue
        lost_since = lost_since or time.monotonic()
        silent = time.monotonic() - lost_since
        if ctx.tolerate(gone) and store is not None:  # the chief declares them; the others wait for it
            if ctx.is_chief and silent > ctx.timeout_s:
                _declare(ctx, store, gone, f"sent no heartbeat for {ctx.timeout_s:.0f} s")
                continue
            silent -= STALE_S + 4 * HEARTBEAT_S
        if silent > ctx.timeout_s:
            # The main thread may be blocked inside a collective that will
            # not return; this is the only way out within the timeout.
            _leave(ctx, store, gone, f"sent no heartbeat for {ctx.timeout_s:.0f} s")


def _read_dropped(ctx: Context, store, live: _Liveness) -> None:
    """The ranks the chief declared lost: no longer waited for; this process exits if among them."""
    if not ctx.is_chief and store.check(["lost"]):
        ctx.dropped = [int(r) for r in store.get("lost").decode().split(",")]
    if ctx.rank in ctx.dropped:
        print(f"scaletrain: error: {ctx.describe(ctx.rank)}: the job went on without this process (silent for "
              f"more than {ctx.timeout_s:.0f} s, or its node was lost); exiting", file=sys.stderr, flush=True)
        os._exit(EXIT_PEER)
    for r in ctx.dropped:
        live.seen.pop(r, None)


def _declare(ctx: Context, store, gone: list[int], what: str) -> None:
    """The chief drops the lost ranks, with their nodes' workers: shards first, then the store."""
    new = sorted(set().union(*(ctx.lost_with(r) for r in gone)) - set(ctx.dropped))
    if ctx.on_drop:
        ctx.on_drop(new)  # a survivor that reads the store next finds the shards told
    ctx.dropped_at.append((new, time.perf_counter()))
    ctx.dropped = ctx.dropped + new
    store.set("lost", ",".join(map(str, ctx.dropped)))
    if ctx.note:
        try:
            with open(os.path.join(os.path.dirname(ctx.note), "dropped"), "w") as fh:
                fh.write(",".join(map(str, ctx.dropped)) + "\n")
        except OSError:
            pass
    nodes = sorted({ctx.plan.procs[r].node + 1 for r in new})
    print(f"scaletrain: warning: {', '.join(ctx.describe(r) for r in gone)} {what}; the job goes on without "
          f"node{'s' * (len(nodes) > 1)} {', '.join(map(str, nodes))}", file=sys.stderr, flush=True)


def _share_stop(ctx: Context, store) -> None:
    if ctx.requests & STOP:
        if not store.check(["stop"]):
            store.set("stop", str(ctx.stop_signal or -1))
    elif store.check(["stop"]):
        ctx.stop_signal = ctx.stop_signal or int(store.get("stop"))
        ctx.requests |= STOP | CHECKPOINT


def stopped(signum: int, where: str) -> Stopped:
    """The error a process ends with after a stop at an agreed step: it names the signal
    (signum, -1 when unknown) and its exit status says so (130 for Ctrl-C)."""
    name = signal.Signals(signum).name if signum > 0 else "a stop request"
    return Stopped(f"stopped by {name} {where}", 130 if signum == signal.SIGINT else EXIT_STOPPED)


def _failed(ctx: Context, store) -> list[int]:
    """The processes that failed first, as the peers that announced a failure named them."""
    out = []
    for r in range(ctx.plan.world_size):
        if r != ctx.rank and store.check([f"failed/{r}"]):
            out += [int(x) for x in store.get(f"failed/{r}").decode().split(",") if int(x) not in out]
    return [r for r in out if r != ctx.rank] or out


def _announcers(ctx: Context, store) -> list[int]:
    return [r for r in range(ctx.plan.world_size) if r != ctx.rank and store.check([f"failed/{r}"])]


def _leave(ctx: Context, store, culprits: list[int], what: str) -> None:
    """Exit this process at once (from the heartbeat thread), naming the peers it left because of."""
    if not culprits:
        return
    write_note(ctx, culprits)
    if store is not None:
        _announce(store, ctx.rank, culprits)
        _linger(ctx)
    names = ", ".join(ctx.describe(r) for r in culprits)
    print(f"scaletrain: error: {ctx.describe(ctx.rank)}: {names} {what}; exiting", file=sys.stderr, flush=True)
    os._exit(EXIT_PEER)


def write_note(ctx: Context, culprits: list[int]) -> None:
    """Tell the launcher which peers this process left because of: it kills a frozen one at once."""
    if ctx.note:
        try:
            with open(ctx.note, "w") as fh:
                fh.write(",".join(map(str, culprits)) + "\n")
        except OSError:
            pass


def _linger(ctx: Context) -> None:
    """Rank 0 serves the store: it stays long enough for every peer to read what it announced."""
    if ctx.rank == 0:
        time.sleep(2 * HEARTBEAT_S + 0.5)


def _announce(store, rank: int, culprits: list[int]) -> None:
    try:
        if not store.check([f"failed/{rank}"]):
            store.set(f"failed/{rank}", ",".join(map(str, culprits)))
            store.add("failed", 1)
    except Exception:  # noqa: BLE001 - the store is gone with rank 0; the heartbeats will tell
        pass


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
        _store().set(f"done/{ctx.rank}", "1")
    except Exception:  # noqa: BLE001 - rank 0, which serves the store, may be gone: all are past the barrier
        pass
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
        ctx._main = _store().clone()
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
    once, then drop the process groups."""
    if culprits:
        write_note(ctx, culprits)
    ctx._stop.set()
    if ctx._thread is not None:
        ctx._thread.join()  # the store client is the heartbeat's until it ends
        _announce(_store(), ctx.rank, culprits or [ctx.rank])
        _linger(ctx)
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - already broken
            pass


@contextmanager
def stop_signals(ctx: Context, names: tuple[str, ...], escalate: bool):
    """While inside: the signals named (cluster.stopping: the job's stop signals and Ctrl-C) ask this process for a checkpoint and a
    stop at the next agreed step, instead of killing it. escalate: a second Ctrl-C interrupts
    at once (a process with no launcher above it; a launcher escalates for its children)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_signal(signum, frame):
        if escalate and signum == signal.SIGINT and ctx.requests & STOP:
            raise KeyboardInterrupt
        ctx.stop_signal = ctx.stop_signal or signum
        ctx.requests |= STOP | CHECKPOINT

    before = {s: signal.signal(s, on_signal) for s in (getattr(signal, n) for n in names)}
    try:
        yield
    finally:
        for s, h in before.items():
            signal.signal(s, h)
