"""Joining a job: the rendezvous, the process groups, and the Context every process carries.

Every process of a job meets the others at the rendezvous (a TCPStore that rank 0 serves, or
torchrun's), joins one gloo world (the parameter servers' traffic and small collectives on host
tensors), then makes the same subgroups in the same order: one per worker node (the replicas
that average inside the node; NCCL on GPUs) and one of all workers (all-reduce). All of it
within cluster.timeout_s, the start-up timeout. From then on collectives and receives wait as
long as a healthy peer needs (p2p.OPERATION_TIMEOUT), and the heartbeats (liveness.py) judge
whether a peer is alive.

Words used across comm/:
- rendezvous (launch/env.Rendezvous): this process's rank and the job's world size, the address
  and port where the processes meet, the job's id (the store's keys live under it, so a process
  of another job never meets this one's), and the launcher that started the process.
- chief: worker 0, rank 0 (plan.py puts workers first): it evaluates, writes the checkpoints and
  the summary, and serves the store.
- tolerant: a job that goes on without a lost worker node (strategies/traits.py); its end meets
  in the store (end.py), where a dropped rank is not waited for.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import math
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from ..config import ClusterConfig, Config
from ..errors import LaunchError
from ..proc import fabric
from ..proc.env import Rendezvous
from ..plan import Plan, Proc, make_plan, node_name
from ..strategies import traits
from .liveness import HEARTBEAT_S, STALE_S, default_store, heartbeat, join, silent_since_joining
from .p2p import OPERATION_TIMEOUT

log = logging.getLogger("scaletrain")


class PeerLost(RuntimeError):
    """A peer died or stopped answering; str() names it, `culprits` its rank where known."""

    def __init__(self, what: str, culprits: list[int] = ()) -> None:
        super().__init__(what)
        self.culprits = list(culprits)


class PortInUse(RuntimeError):
    """The rendezvous port is taken; str() names it."""


@dataclass
class Context:
    """Where this process sits in the plan, and its process groups."""

    plan: Plan
    me: Proc
    timeout_s: float = 60.0
    node_group: object = None     # this node's replicas (None when alone); with stages, of this stage
    workers_group: object = None  # the replicas that average gradients (None when alone); with stages, of this stage
    workers_cpu_group: object = None  # every worker over gloo, for host tensors (workers_group itself on CPU)
    job_group: object = None      # every worker (None when alone): workers_group unless there are stages
    pipe_group: object = None     # the stages of this replica (None without parallel.stages)
    gone: list[int] = field(default_factory=list)  # ranks seen missing by the heartbeat thread
    requests: int = 0  # liveness.CHECKPOINT | STOP bits asked of this process, not yet acted on
    stop_signal: int = 0  # the number of the signal that asked for the stop (-1: heard of, not which)
    note: str = ""  # file where this process writes the ranks it left because of (for its launcher)
    tolerant: bool = False  # the strategy trains on without lost worker nodes (see the module doc)
    survivable: Callable[[set], bool] = lambda lost: False  # whether the job goes on without these ranks
    lost_with: Callable[[int], list] = lambda rank: [rank]  # the ranks lost with one (its node's workers)
    on_drop: Callable[[list], None] | None = None  # the chief's heartbeat thread, before declaring ranks lost
    dropped: list[int] = field(default_factory=list)  # ranks declared lost; the job goes on without them
    # A replacement (cluster.replacements) joins a running job: a member from when the chief admits it (ring.py)
    late: bool = False
    member_since: float = 0.0  # monotonic time from which a `lost` that lists this rank means it was dropped
    joining: dict = field(default_factory=dict)  # the chief: dropped rank -> its replacement's token, to admit
    admits: int = 0  # the chief: the admissions it committed (comm/ring.py's view, with `dropped`)
    admitted_tokens: set = field(default_factory=set)  # the chief: the replacements admitted so far
    lock: threading.Lock = field(default_factory=threading.Lock)  # dropped and joining: two threads change them
    joined: float = field(default_factory=time.time)  # when this process joined its job (wall clock)
    # chief: (ranks, time.perf_counter(), seconds they were silent before) of each declaration
    dropped_at: list = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _finishing: threading.Event = field(default_factory=threading.Event)  # in the final barrier: rank 0 may leave
    _thread: threading.Thread | None = None
    store: object = None  # the job's store: the heartbeat thread's client (clients are not shared across threads)
    _main: object = None  # the main thread's store client (store_gather, finish)
    _beat: object = None  # the beat's store client (liveness.fork_beat), kept open

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

    def admitted(self) -> None:
        """A replacement is a member from now on (the chief removed it from `lost` before saying so)."""
        with self.lock:
            self.late, self.member_since = False, time.monotonic()

    def tolerate(self, ranks) -> bool:
        """Whether the job goes on without `ranks` (with their nodes), besides those dropped."""
        return self.survivable(set(self.dropped).union(*(self.lost_with(r) for r in ranks)))

    def node_workers(self) -> list[int]:
        """The ranks this one averages with inside its node: its replicas, of its stage."""
        return [p.rank for p in self.plan.workers if p.node == self.me.node and p.stage == self.me.stage]

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


def single() -> Context:
    """The Context of a job of one process."""
    plan = make_plan(ClusterConfig(), ps_required=False)
    return Context(plan, plan.procs[0])


def init(cfg: Config, plan: Plan, rdzv: Rendezvous) -> Context:
    """Meet the job's processes at the rendezvous `rdzv`, join the world and make the subgroups; start
    the beat and the heartbeat thread (liveness.py). All of it
    within cluster.timeout_s, the start-up timeout (every process starts at once): a process that
    does not join in time, or stops meanwhile, fails the start-up, named (PeerLost.culprits)."""
    c = cfg.cluster
    timeout = datetime.timedelta(seconds=c.timeout_s)
    loopback = rdzv.launcher == "local" and _is_loopback(rdzv.addr)
    os.environ.update(fabric.socket_env(c.ifname, loopback))  # gloo's and NCCL's sockets (proc/fabric.py)
    store, met = None, False
    try:
        if rdzv.launcher == "torchrun" and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            # torchrun without its agent's store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1): torch's env://
            # rendezvous makes one; no replacement can join it (keep.py)
            dist.init_process_group("gloo", init_method="env://", rank=rdzv.rank, world_size=rdzv.world,
                                    timeout=timeout)
            store, met = default_store(), True
            beat = join(store, rdzv.rank)
        else:
            # Keys under the job's id: a process of another job that reaches this store never meets ours.
            store = dist.PrefixStore(f"scaletrain/{rdzv.job}", _tcp_store(rdzv, timeout, loopback))
            beat = join(store, rdzv.rank)  # beating from here, a process stopped in the rendezvous is told apart
            if rdzv.late:  # a replacement: the others' groups were made long ago; it joins the ring alone (ring.py)
                return _start_heartbeat(_context(cfg, plan, rdzv, store, beat, late=True))
            dist.init_process_group("gloo", store=store, rank=rdzv.rank, world_size=rdzv.world, timeout=timeout)
            met = True
        return _groups(cfg, plan, rdzv, timeout, store, beat)
    except (PortInUse, LaunchError):
        raise
    except (RuntimeError, TimeoutError) as e:  # PeerLost too: check_groups's
        raise _no_start(rdzv, plan, store, met, timeout, e) from None


def _no_start(rdzv: Rendezvous, plan: Plan, store, met: bool, timeout: datetime.timedelta, err: BaseException) -> PeerLost:
    """The error of a start-up that failed, naming the processes that did not join, or stopped beating,
    where there are such (a store that does not answer is rank 0's, which serves it)."""
    if store is None:
        culprits = [0] if rdzv.launcher != "torchrun" and rdzv.rank else []
    else:
        culprits = silent_since_joining(store, rdzv.world, rdzv.rank)
    if not culprits:
        return err if isinstance(err, PeerLost) else _no_rendezvous(rdzv, timeout, err)
    who = ", ".join(plan.describe(r) for r in culprits)
    if met:
        return PeerLost(f"{who} stopped during the job's start-up (frozen or dead)", culprits)
    return PeerLost(f"no rendezvous for job {rdzv.job} at {rdzv.addr}:{rdzv.port}: {who} did not join within "
                    f"{timeout.total_seconds():.0f} s (frozen, dead, or never started)", culprits)


def _groups(cfg: Config, plan: Plan, rdzv: Rendezvous, timeout: datetime.timedelta, store, beat) -> Context:
    """The subgroups, checked; the heartbeat thread."""
    c = cfg.cluster
    ctx = _context(cfg, plan, rdzv, store, beat)
    me = ctx.me
    on_gpu = agree_on_devices(plan, me.rank)
    local_backend = "nccl" if on_gpu and c.backend != "gloo" else "gloo"
    # NCCL communicators are built now, on this process's GPU (set_device came first), not at their first
    # collective: that can be step 1000, after a store timeout, before the first checkpoint.
    bound = torch.device(me.device) if local_backend == "nccl" and me.role == "worker" else None
    # Collective: every rank creates every group, in the same order.
    made = []  # (what, ranks, group)

    def group(what: str, ranks: list[int], backend: str = local_backend):
        g = dist.new_group(ranks, timeout=timeout, backend=backend,
                           device_id=bound if me.rank in ranks and backend == local_backend else None)
        made.append((what, ranks, g))
        return g if me.rank in ranks and len(ranks) > 1 else None

    staged = plan.stages > 1
    for node in range(plan.worker_nodes):
        for s in range(plan.stages):
            ranks = [p.rank for p in plan.workers if p.node == node and p.stage == s]
            g = group(f"the replicas of {node_name(node)}" + (f", stage {s + 1}" if staged else ""), ranks)
            ctx.node_group = g or ctx.node_group
    workers = [p.rank for p in plan.workers]
    for s in range(plan.stages if staged else 0):  # the data-parallel group of each stage
        g = group(f"stage {s + 1} of every replica", [p.rank for p in plan.workers if p.stage == s])
        ctx.workers_group = g or ctx.workers_group
    ctx.job_group = group("all workers", workers)
    if not staged:
        ctx.workers_group = ctx.job_group
    ctx.workers_cpu_group = ctx.job_group if local_backend == "gloo" else group("all workers (host tensors)",
                                                                                   workers, "gloo")
    for r in range(plan.replicas if staged else 0):  # the stages of each replica, for activations
        g = group(f"the stages of replica {r}", plan.pipeline_of(next(p for p in plan.workers
                                                                      if plan.replica_of(p) == r)))
        ctx.pipe_group = g or ctx.pipe_group
    groups = [g for _, _, g in made]
    check_groups(made, me, timeout)  # still under the start-up timeout: a broken fabric fails now
    # Joined: from now on an operation waits as long as a healthy peer works; the heartbeats judge liveness.
    for g in [None] + [g for g in groups if not dist.distributed_c10d._rank_not_in_group(g)]:
        dist.distributed_c10d._set_pg_timeout(OPERATION_TIMEOUT, g)
    return _start_heartbeat(ctx)


def _context(cfg: Config, plan: Plan, rdzv: Rendezvous, store, beat, late: bool = False) -> Context:
    ctx = Context(plan, plan.procs[rdzv.rank], cfg.cluster.timeout_s, tolerant=traits.tolerant(cfg),
                  survivable=lambda lost: traits.survivable(cfg, plan, lost),
                  lost_with=lambda rank: traits.lost_with(plan, rank), late=late,
                  member_since=math.inf if late else 0.0)
    ctx.store, ctx._beat = store, beat
    return ctx


def _start_heartbeat(ctx: Context) -> Context:
    ctx._thread = threading.Thread(target=heartbeat, args=(ctx,), daemon=True, name="heartbeat")
    ctx._thread.start()
    return ctx


def agree_on_devices(plan: Plan, rank: int) -> bool:
    """Whether the workers compute on GPUs: every one does, or none. Each process found its device
    on its own host (launch/env.plan_for), and one without CUDA would pick gloo while its peers pick
    NCCL. Collective over the world (gloo): every process gets the same answer, or raises the same
    LaunchError."""
    mine = torch.tensor([int(plan.procs[rank].device.startswith("cuda"))])
    every = [torch.zeros_like(mine) for _ in range(plan.world_size)]
    dist.all_gather(every, mine)
    on_gpu = [p.rank for p in plan.workers if int(every[p.rank])]
    if on_gpu and len(on_gpu) < len(plan.workers):
        cpu = next(p.rank for p in plan.workers if p.rank not in on_gpu)
        others = f" and {len(on_gpu) - 1} other worker{'s' * (len(on_gpu) > 2)}" if len(on_gpu) > 1 else ""
        raise LaunchError(f"{plan.describe(cpu)} found no CUDA GPU while {plan.describe(on_gpu[0])}{others} "
                          "found one: every worker must see one (`scaletrain doctor` on its node says why), or set "
                          "train.device = 'cpu'")
    return bool(on_gpu)


def check_groups(made: list, me: Proc, timeout: datetime.timedelta) -> None:
    """One small all-reduce in each group this process belongs to, waited for, so that a group that
    cannot work (a fabric NCCL cannot use, a peer on a wrong interface) fails at start-up, naming it.
    NCCL groups add a CUDA tensor (one host-device sync each, once); gloo groups a host tensor."""
    for what, ranks, g in made:
        if me.rank not in ranks:
            continue
        backend = dist.get_backend(g)
        t = torch.ones(1, device=me.device if backend == "nccl" else "cpu")
        try:
            dist.all_reduce(t, group=g)
            got = int(t.item())  # host-device sync on NCCL: the communicator has really run
        except Exception as e:  # noqa: BLE001 - any failure here is the group's, said in one line
            raise PeerLost(f"{what} (ranks {_ranks(ranks)}) could not run a collective over {backend} within "
                           f"{timeout.total_seconds():.0f} s of start-up: {str(e).strip().splitlines()[-1]}; "
                           "check cluster.ifname and the fabric (NCCL_DEBUG=INFO tells more)") from None
        if got != len(ranks):
            raise PeerLost(f"{what} (ranks {_ranks(ranks)}) summed {got} over {backend} instead of {len(ranks)}")


def _ranks(ranks: list[int]) -> str:
    return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 and ranks == list(range(ranks[0], ranks[-1] + 1)) else \
        ", ".join(map(str, ranks))


def _no_rendezvous(rdzv: Rendezvous, timeout: datetime.timedelta, err: BaseException) -> PeerLost:
    return PeerLost(f"no rendezvous for job {rdzv.job} at {rdzv.addr}:{rdzv.port}: the job's {rdzv.world} "
                    f"processes did not all join within {timeout.total_seconds():.0f} s "
                    f"({str(err).strip().splitlines()[-1]})")


def _is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(addr)).is_loopback
    except (OSError, ValueError):
        return False


def _tcp_store(rdzv: Rendezvous, timeout: datetime.timedelta, loopback: bool):
    """The job's TCPStore: the others connect to rank 0, which serves it on a socket
    of its own, bound to loopback for local jobs and to every interface otherwise."""
    if rdzv.rank != 0 or rdzv.launcher == "torchrun":  # under torchrun the agent of the endpoint's host serves it
        return dist.TCPStore(rdzv.addr, rdzv.port, rdzv.world, False, timeout)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(("127.0.0.1" if loopback else "", rdzv.port))
        sock.listen(1024)
    except OSError as e:
        sock.close()
        raise PortInUse(f"cannot listen on port {rdzv.port} for the rendezvous ({e.strerror}); "
                        "set cluster.master_port to a free port") from None
    # The store takes the socket over (and closes it when it ends).
    return dist.TCPStore(rdzv.addr, rdzv.port, rdzv.world, True, timeout, wait_for_workers=False,
                         master_listen_fd=sock.detach())
