"""The replicas' all-reduce group of a job that goes on without a lost worker node
(cluster.survive_loss, strategies/traits.py: reforms).

A gloo process group is fixed at its making: once a member is killed, its peers'
collectives fail (the connection closed), and once one is frozen (SIGSTOP, a hung
node) they wait for it for ever. The Ring is a group made anew each time the chief
drops ranks (liveness.py): a ProcessGroupGloo over the job's store, under a prefix
named by the ranks dropped so far, so every survivor makes the same one.

Each collective is waited for while watching `Context.dropped`. When it fails, or a
member is dropped while it waits, the ring waits for the chief's declaration (the
heartbeats bound it: cluster.timeout_s), makes the new group and agrees on where
its members stand: a member may have finished the collective (and stepped) that its
peers did not. Then the member that went furthest sends its state to the others
(`state` and `adopt`, torch.save bytes: whatever it holds, optimizer state
included), and those that were one collective behind take its result instead of
redoing theirs. Every member that was at the front redoes its collective in the
new group: the step in progress is not lost, only the lost replicas' share of it.

torchft (0.2.0) re-forms its groups the same way, a gloo group over a store prefix
per quorum, but it is not used here: `import torchft` fails without its three
opentelemetry packages (its otel.py imports them unconditionally), its quorum
needs a lighthouse server process and an RPC every step, and its healing sends
the state over HTTP, outside torch.distributed. Here the quorum is the chief's
declaration, which the heartbeats already make, and costs no step anything.

A group left this way may still have gloo threads waiting on the frozen peer, and
they may still write into the collective's buffer: both are kept (`_left`), never
destroyed or reused (a group's destructor would wait for those threads).
"""

from __future__ import annotations

import datetime
import io
import threading
import time
from typing import Callable

import torch
import torch.distributed as dist

from .end import _main_store
from .groups import Context
from .liveness import HEARTBEAT_S, STALE_S
from .p2p import OPERATION_TIMEOUT


class Ring:
    """An all-reduce group of the workers the job still has."""

    def __init__(self, ctx: Context, state: Callable[[], dict], adopt: Callable[[dict], None]) -> None:
        """state(): what this member holds (weights, optimizer, progress), for a member behind it; adopt(d):
        take such a state. Collective over the workers: every one makes the first group."""
        self.ctx, self.state, self.adopt = ctx, state, adopt
        self.workers = [p.rank for p in ctx.plan.workers]
        self.store = _main_store(ctx).clone()  # the groups' own client: they connect through it
        self.done = 0  # the collectives this member finished
        self.last = torch.zeros(0)  # the small result of the last one (requests), for a member behind
        # each re-forming: its wait for the chief's word and its healing, in seconds; whether this member was behind
        self.losses: list[dict] = []
        self._left: list = []  # (group, buffer) of each collective left: never destroyed nor reused
        self.buf: torch.Tensor | None = None
        self._failed: BaseException | None = None
        self._make()

    @property
    def size(self) -> int:
        return len(self.members)

    def _dropped(self) -> set[int]:
        """The ranks the chief dropped: as this process's heartbeat thread last read them, and as the store
        says now (the thread reads it once a beat; the ring, waiting to re-form, sooner)."""
        got = set(self.ctx.dropped)
        if self.store.check(["lost"]):
            got.update(int(r) for r in self.store.get("lost").decode().split(",") if r)
        return got

    def _make(self) -> None:
        dropped = self._dropped()
        self.members = [r for r in self.workers if r not in dropped]
        tag = ",".join(map(str, sorted(set(self.workers) - set(self.members)))) or "-"
        # Its making waits for every member to connect: a member dropped meanwhile fails it within this bound
        bound = datetime.timedelta(seconds=self.ctx.timeout_s + STALE_S + 10)
        self.pg = dist.ProcessGroupGloo(dist.PrefixStore(f"ring/{tag}", self.store),
                                        self.members.index(self.ctx.rank), len(self.members), bound)

    def allreduce(self, t: torch.Tensor, small: int = 0, op=dist.ReduceOp.SUM) -> bool:
        """Sum `t` (a host tensor) over the members, in place. Its last `small` elements are the
        collective's small result (requests), kept for a member behind. False where this member was
        behind: it took the front member's state (adopt) and `t` holds that member's small result at its
        end; its own step is not to be applied."""
        while True:
            # gloo gets a buffer of the ring's: one a failed collective left may still be written by its thread
            buf = self.buf = self.buf if self.buf is not None and self.buf.shape == t.shape and \
                self.buf.dtype == t.dtype else torch.empty_like(t)
            buf.copy_(t)
            opts = dist.AllreduceOptions()
            opts.reduceOp, opts.timeout = op, OPERATION_TIMEOUT  # a healthy peer may take any time
            if self._waited(self.pg.allreduce([buf], opts)):  # collective over the members
                t.copy_(buf)
                self.done += 1
                self.last = t[t.numel() - small:].clone()
                return True
            self._left.append((self.pg, buf))
            self.buf = None
            if not self._reform():
                t[t.numel() - small:] = self.last
                return False

    def _waited(self, work) -> bool:
        """Whether the work finished; False once it failed or a member was dropped while it waited. Woken by
        the work's end itself (its future's callback, from gloo's thread): no polling delay on a step."""
        ended = threading.Event()
        work.get_future().add_done_callback(lambda _: ended.set())
        while not ended.wait(HEARTBEAT_S / 10):
            if set(self.members) & set(self.ctx.dropped):
                return False
        try:
            work.wait()
            return True
        except RuntimeError as e:
            self._failed = e
            return False

    def _reform(self) -> bool:
        """Make the group of the members left, once the chief dropped the lost ones; agree on where they
        stand. False where this member was behind the front (it adopted the front's state)."""
        started = time.perf_counter()
        while True:
            bound = time.monotonic() + self.ctx.timeout_s + 2 * STALE_S + 10  # the heartbeats decide within it
            while not set(self.members) & self._dropped():
                if time.monotonic() > bound:  # no peer lost: the failure is this process's own
                    raise self._failed or RuntimeError("the replicas' all-reduce failed")
                time.sleep(HEARTBEAT_S / 10)
            declared = time.perf_counter()
            try:
                self._make()
                break
            except RuntimeError as e:  # another member lost while it connected: the next drop follows
                self._failed = e
        done = torch.tensor([float(self.done), -float(self.done)])
        self._reduce(done, dist.ReduceOp.MAX)
        front, low = int(done[0]), -int(done[1])
        behind = self.done < front
        if low < front:  # some finished the collective their peers did not: the lowest at the front sends
            leader = torch.tensor([float(len(self.members) if behind else self.members.index(self.ctx.rank))])
            self._reduce(leader, dist.ReduceOp.MIN)
            self._send_state(int(leader.item()))
        self.done = front
        self.losses.append({"declared_s": declared - started, "healed_s": time.perf_counter() - declared,
                            "behind": behind})
        return not behind

    def _reduce(self, t: torch.Tensor, op) -> None:
        opts = dist.AllreduceOptions()
        opts.reduceOp, opts.timeout = op, OPERATION_TIMEOUT
        self.pg.allreduce([t], opts).wait()

    def _send_state(self, root: int) -> None:
        """The front member `root`'s state, with its last small result, to every member."""
        me = self.members.index(self.ctx.rank)
        data = b""
        if me == root:
            buf = io.BytesIO()
            torch.save({"state": self.state(), "last": self.last}, buf)
            data = buf.getvalue()
        size = torch.tensor([len(data)], dtype=torch.int64)
        self._broadcast(size, root)
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8) if me == root else \
            torch.empty(int(size.item()), dtype=torch.uint8)
        self._broadcast(payload, root)
        if me != root:
            got = torch.load(io.BytesIO(payload.numpy().tobytes()), map_location="cpu")  # adopt copies to the device
            self.adopt(got["state"])
            self.last = got["last"]

    def _broadcast(self, t: torch.Tensor, root: int) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor, opts.timeout = root, 0, OPERATION_TIMEOUT
        self.pg.broadcast([t], opts).wait()
