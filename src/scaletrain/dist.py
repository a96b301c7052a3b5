"""Process groups, liveness and failure reports. Nothing happens at import time.

Every process joins one gloo world (PS traffic and small collectives on CPU
tensors), then makes the same subgroups in the same order: one per worker
node (the replicas that average inside the node; NCCL on GPUs) and one of all
workers (all-reduce). A heartbeat thread writes `hb/RANK` into the
rendezvous store; a watchdog ends the process when a peer's heartbeat is
older than cluster.timeout_s, so no process waits forever on a dead one, and
every error names the rank and node that went missing.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass, field

import torch.distributed as dist

from .config import Config
from .plan import Plan, Proc, make_plan

log = logging.getLogger("scaletrain")
HEARTBEAT_S = 0.5
STALE_S = 3.0  # a heartbeat older than this marks its rank as missing


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
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

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

    def node_workers(self) -> list[int]:
        return [p.rank for p in self.plan.workers if p.node == self.me.node]

    def lost(self, err: BaseException) -> PeerLost | None:
        """The error naming the missing peers, or None when every peer is alive
        (then `err` is not a lost peer's doing)."""
        if not self.distributed:
            return None
        deadline = time.time() + STALE_S + 2
        while not self.gone and time.time() < deadline:  # a dead peer's heartbeat needs a moment to age
            time.sleep(HEARTBEAT_S)
        if not self.gone:
            return None
        who = ", ".join(self.describe(r) for r in self.gone)
        return PeerLost(f"{self.describe(self.rank)}: lost contact with {who}: {str(err).splitlines()[0]}")


def _store():
    return dist.distributed_c10d._get_default_store()


def single() -> Context:
    from .config import ClusterConfig

    plan = make_plan(ClusterConfig(), ps_required=False)
    return Context(plan, plan.procs[0])


def init(cfg: Config, plan: Plan, seat) -> Context:
    """Join the job's world and make the subgroups; start heartbeat and watchdog."""
    c = cfg.cluster
    timeout = datetime.timedelta(seconds=c.timeout_s)
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
    ctx = Context(plan, plan.procs[seat.rank], c.timeout_s)
    local_backend = "nccl" if plan.procs[0].device.startswith("cuda") else "gloo"
    # Collective: every rank creates every group, in the same order.
    for node in range(plan.worker_nodes):
        ranks = [p.rank for p in plan.workers if p.node == node]
        g = dist.new_group(ranks, timeout=timeout, backend=local_backend)
        if ctx.me.node == node and ctx.me.role == "worker" and len(ranks) > 1:
            ctx.node_group = g
    g = dist.new_group([p.rank for p in plan.workers], timeout=timeout, backend=local_backend)
    if ctx.me.role == "worker" and len(plan.workers) > 1:
        ctx.workers_group = g
    ctx._thread = threading.Thread(target=_heartbeat, args=(ctx,), daemon=True, name="heartbeat")
    ctx._thread.start()
    return ctx


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


def _missing(store, ctx: Context) -> list[int]:
    """Ranks whose heartbeat is stale and which did not finish cleanly."""
    now, out = time.time(), []
    for r in range(ctx.plan.world_size):
        if r != ctx.rank and not store.check([f"done/{r}"]):
            if not store.check([f"hb/{r}"]) or now - float(store.get(f"hb/{r}")) > STALE_S:
                out.append(r)
    return out


def _heartbeat(ctx: Context) -> None:
    """The only user of the store after start-up (store clients are not shared across threads)."""
    store, started, stale_since = _store(), time.time(), None
    while not ctx._stop.wait(HEARTBEAT_S):
        try:
            store.set(f"hb/{ctx.rank}", str(time.time()))
            gone = _missing(store, ctx) if time.time() - started > STALE_S else []
        except Exception:  # noqa: BLE001 - the store lives in rank 0: it is gone
            gone = [0]
        ctx.gone = gone
        if not gone:
            stale_since = None
            continue
        stale_since = stale_since or time.time()
        if time.time() - stale_since > ctx.timeout_s:
            # The main thread may be blocked inside a collective that will
            # not return; this is the only way out within the timeout.
            names = ", ".join(ctx.describe(r) for r in gone)
            print(f"scaletrain: error: {ctx.describe(ctx.rank)}: no heartbeat from {names} for "
                  f"{ctx.timeout_s:.0f} s; exiting", file=sys.stderr, flush=True)
            os._exit(3)


def finish(ctx: Context) -> None:
    """Mark this process done, wait for all, and leave the world."""
    if not ctx.distributed:
        return
    ctx._stop.set()
    ctx._thread.join()  # the store client is not shared across threads
    _store().set(f"done/{ctx.rank}", "1")
    dist.barrier()
    dist.destroy_process_group()


def abort(ctx: Context) -> None:
    ctx._stop.set()
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - already broken
            pass
