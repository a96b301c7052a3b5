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

A replacement (a process its launcher started for a dropped rank, cluster.replacements)
joins at a step boundary: it asks in the store (`join/RANK`), the chief's heartbeat
thread sees it (Context.joining), and the chief's next collective carries one more
element that says so to every member. At the next step boundary (`boundary`: every
member applied that collective's update) the chief commits the admission
(liveness.admit: the store's `admits` and `lost` in one write, its view), and every
member and the replacement make the group of that view and agree where they stand,
as after a loss: the replacement enters a collective behind everyone, so the front's
lowest member sends it its state (weights, optimizer, images applied): it never reads
a checkpoint. Every group is made of a view the chief committed, and its making starts
over whenever the view changes: a member that lost the flagged collective to a killed
peer, and one that finished it, meet in the same group whatever came first.

torchft (0.2.0) re-forms its groups the same way, a gloo group over a store prefix
per quorum, but it is not used here: `import torchft` fails without its three
opentelemetry packages (its otel.py imports them unconditionally), its quorum
needs a lighthouse server process and an RPC every step, and its healing sends
the state over HTTP, outside torch.distributed. Here the quorum is the chief's
declaration, which the heartbeats already make, and costs no step anything.

A group left this way may still have gloo threads waiting on the frozen peer, and
they may still write into the collective's buffer: both are kept for ever
(`_leave`), never destroyed or reused (a group's destructor would wait for those
threads). A member one collective behind a front that has ended the job meanwhile
(end.finish marked it done) ends too (`Finished`).
"""

from __future__ import annotations

import ctypes
import io
import os
import threading
import time
from typing import Callable

import torch
import torch.distributed as dist

from ..proc.env import LATE
from .end import _main_store
from .groups import Context
from .liveness import HEARTBEAT_S, STALE_S, admit
from .p2p import OPERATION_TIMEOUT


class Finished(Exception):
    """A member left the ring at the job's end while this one was a collective behind it."""


class _Lost(Exception):
    """A collective of the ring failed, or a member was dropped while it waited."""


def _keep_for_ever(obj) -> None:
    """A reference that is never released: a gloo group still waiting on a frozen peer would make its
    destructor (at the latest, at the interpreter's exit) wait for that peer for ever."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


class Ring:
    """An all-reduce group of the workers the job still has."""

    def __init__(self, ctx: Context, state: Callable[[], dict], adopt: Callable[[dict], None]) -> None:
        """state(): what this member holds (weights, optimizer, progress), for a member behind it; adopt(d):
        take such a state. Collective over the workers: every one makes the first group."""
        self.ctx, self.state, self.adopt = ctx, state, adopt
        self.workers = [p.rank for p in ctx.plan.workers]
        self.store = _main_store(ctx).clone()  # this thread's client (the groups are made on a thread of theirs)
        self.done = 0  # the collectives this member finished
        self.last = torch.zeros(0)  # the small result of the last one (requests), for a member behind
        # each re-forming: its wait for the chief's word and its healing, in seconds; whether this member was behind
        self.losses: list[dict] = []
        self.buf: torch.Tensor | None = None
        self._failed: BaseException | None = None
        self.view: tuple = ()  # (admissions, dropped ranks) the group was made of: its prefix
        self.joins: list[dict] = []  # the chief: each admission, its ranks, when and how long it paused the ring
        self._flagged: dict = {}  # the chief: the replacements its last collective said it admits (rank -> token)
        self._admitted = False  # the last collective said so: regroup at the next step boundary
        self.healed_s: dict = {}  # a replacement: how long it took to ask, to be admitted, to adopt (seconds)
        if ctx.late:
            self._join()
        else:
            self._make()

    @property
    def size(self) -> int:
        return len(self.members)

    def _view(self) -> tuple[int, set[int]]:
        """The admissions so far and the ranks dropped, as the chief committed them: its own (it writes the
        store's), or the store's, in one read (the heartbeat thread's copy follows it a beat late)."""
        if self.ctx.is_chief:
            with self.ctx.lock:
                return self.ctx.admits, set(self.ctx.dropped)
        admits, lost = self.store.multi_get(["admits", "lost"])
        return int(admits), {int(r) for r in lost.decode().split(",") if r}

    def _dropped(self) -> set[int]:
        return self._view()[1]

    def _finished(self, members: list[int]) -> bool:
        """Whether a member ended its part of the job (end.finish marks it done): it joins no group again."""
        return any(r != self.ctx.rank and self.store.check([f"done/{r}"]) for r in members)

    def _make(self) -> None:
        """The group of the workers not dropped, under a prefix the dropped ranks name, so every member makes
        the same one. Its making waits for every member to connect, as long as a healthy one needs (the
        chief may be evaluating alone); made on a thread of its own, it is left for a new group once a
        member is dropped meanwhile."""
        while True:
            view = self._view()
            admits, dropped = view
            members = [r for r in self.workers if r not in dropped]
            tag = f"{admits}:" + (",".join(map(str, sorted(dropped & set(self.workers)))) or "-")
            made: dict = {}

            def make(store=self.store.clone()) -> None:  # a client of its own: clients are not shared
                store.set_timeout(OPERATION_TIMEOUT)
                try:
                    made["pg"] = dist.ProcessGroupGloo(dist.PrefixStore(f"ring/{tag}", store),
                                                       members.index(self.ctx.rank), len(members), OPERATION_TIMEOUT)
                except RuntimeError as e:
                    made["error"] = e

            maker = threading.Thread(target=make, daemon=True, name="ring")
            maker.start()
            while maker.is_alive():
                maker.join(HEARTBEAT_S / 5)
                if maker.is_alive() and self._view() != view:
                    break  # a member lost, or one admitted, while the group was made: the group of the new view
                if maker.is_alive() and self._finished(members):
                    raise Finished
            if "pg" in made:
                self.members, self.pg, self.view = members, made["pg"], view
                return
            if "error" in made:
                raise made["error"]

    def allreduce(self, t: torch.Tensor, small: int = 0, op=dist.ReduceOp.SUM) -> bool:
        """Sum `t` (a host tensor) over the members, in place. Its last `small` elements are the
        collective's small result (requests), kept for a member behind. False where this member was
        behind: it took the front member's state (adopt) and `t` holds that member's small result at its
        end; its own step is not to be applied. Raises Finished where the front ended the job meanwhile."""
        n = t.numel()
        if self.ctx.is_chief and self.ctx.joining and not self._admitted:
            self._flagged = dict(self.ctx.joining)
        flag = float(bool(self._flagged))
        while True:
            # gloo gets a buffer of the ring's: one a failed collective left may still be written by its thread.
            # Its one more element: whether the chief admits replacements after this collective.
            buf = self.buf = self.buf if self.buf is not None and self.buf.numel() == n + 1 and \
                self.buf.dtype == t.dtype else torch.empty(n + 1, dtype=t.dtype, pin_memory=t.is_pinned())
            buf[:n].copy_(t.reshape(-1))
            buf[n], flag = flag, 0.0  # redone after a loss: the group made since holds the view committed then
            try:
                self._run(self.pg.allreduce, [buf], dist.AllreduceOptions(), reduceOp=op)
            except _Lost:
                self._leave(buf)
                if not self._reform():
                    t[n - small:] = self.last
                    return False
                continue
            t.copy_(buf[:n].view_as(t))
            self.done += 1
            self.last = t[n - small:].clone()
            if buf[n] > 0:  # admitted at the next step boundary, once every member applied this one's update
                self._admitted = True
            return True

    def _run(self, call, tensors: list, opts, **fields) -> None:
        """A collective over the members, waited for as long as a healthy peer needs (an evaluation, a
        checkpoint); raises _Lost once it failed or a member was dropped while it waited. Woken by the
        work's end itself (its future's callback, from gloo's thread): no polling delay on a step."""
        for k, v in dict(fields, timeout=OPERATION_TIMEOUT).items():
            setattr(opts, k, v)
        work = call(tensors, opts)  # collective over the members
        ended = threading.Event()
        work.get_future().add_done_callback(lambda _: ended.set())
        while not ended.wait(HEARTBEAT_S / 10):
            # The heartbeat thread's copy hints, the chief's list decides (a rank admitted since may linger there)
            if set(self.members) & set(self.ctx.dropped) and set(self.members) & self._dropped():
                raise _Lost
        try:
            work.wait()
        except RuntimeError as e:
            self._failed = e
            raise _Lost from None

    def _leave(self, buf: torch.Tensor | None = None) -> None:
        """Leave the group (and the buffer its collective had): never destroyed nor reused."""
        _keep_for_ever(self.pg)
        if buf is not None:
            _keep_for_ever(buf)
            self.buf = None

    def _reform(self) -> bool:
        """Make the group of the members left, once the chief dropped the lost ones; agree on where they
        stand. False where this member was behind the front (it adopted the front's state)."""
        started = time.perf_counter()
        while True:
            bound = time.monotonic() + self.ctx.timeout_s + 2 * STALE_S + 10  # the heartbeats decide within it
            while not set(self.members) & self._dropped():
                if self._finished(self.members):
                    raise Finished
                if time.monotonic() > bound:  # no peer lost: the failure is this process's own
                    raise self._failed or RuntimeError("the replicas' all-reduce failed")
                time.sleep(HEARTBEAT_S / 10)
            declared = time.perf_counter()
            behind = not self._regroup()
            break
        self.losses.append({"declared_s": declared - started, "healed_s": time.perf_counter() - declared,
                            "behind": behind})
        return not behind

    def _regroup(self) -> bool:
        """Make the group of the view the chief committed and agree where its members stand; False where
        this member was behind (it adopted the front's state)."""
        while True:
            self._make()
            try:
                return not self._agree()
            except _Lost:  # another member lost while they agreed: again, without it
                self._leave()

    def _agree(self) -> bool:
        """Where the members stand: whether this one is a collective behind the front, whose lowest member
        then sends its state to those behind."""
        done = torch.tensor([self.done, -self.done], dtype=torch.int64)
        self._run(self.pg.allreduce, [done], dist.AllreduceOptions(), reduceOp=dist.ReduceOp.MAX)
        front, low = int(done[0]), -int(done[1])
        behind = self.done < front
        if low < front:  # some finished the collective their peers did not
            leader = torch.tensor([len(self.members) if behind else self.members.index(self.ctx.rank)])
            self._run(self.pg.allreduce, [leader], dist.AllreduceOptions(), reduceOp=dist.ReduceOp.MIN)
            self._send_state(int(leader), behind)
        self.done = front
        return behind

    def boundary(self) -> None:
        """At a step boundary (before this step's collective), after a collective that said the chief admits
        replacements: the chief commits them, and every member makes the group of the view committed, the
        replacement with them, which takes the front's state (its side: _join). A member waits for the view
        to move from its group's: the chief commits it, or, where the chief lost that collective to a killed
        peer, the chief's drop of that peer does."""
        if not self._admitted:
            return
        self._admitted, started = False, time.perf_counter()
        if self.ctx.is_chief:
            tokens = {r: self.ctx.joining.get(r, token) for r, token in self._flagged.items()}  # the newest asked
            self._flagged = {}
            admit(self.ctx, tokens, self.store)
            for token in tokens.values():
                self.store.set(f"ring/admitted/{token}", "1")
        else:
            while self._view() == self.view:
                if self._finished(self.workers):
                    raise Finished
                time.sleep(HEARTBEAT_S / 10)
        old = self.pg
        self._regroup()
        del old  # every collective of it ended: released, no peer to wait for
        if self.ctx.is_chief:
            self.joins.append({"ranks": sorted(tokens), "tokens": list(tokens.values()), "t": started,
                               "pause_s": time.perf_counter() - started})

    def joined(self, final: bool = False) -> list[dict]:
        """The admissions so far (the chief), with what each replacement measured (final: read from the store)."""
        out = []
        for j in self.joins:
            row = {k: v for k, v in j.items() if k != "tokens"}
            for token in j["tokens"] if final else ():
                if self.store.check([f"ring/healed/{token}"]):
                    row.update(zip(("start_s", "wait_s", "adopt_s"),
                                   map(float, self.store.get(f"ring/healed/{token}").decode().split(","))))
            out.append(row)
        return out

    def _join(self) -> None:
        """A replacement: ask the chief to be admitted, wait for it (the members train meanwhile), make the
        group with them and adopt the chief's state."""
        me = self.ctx.rank
        token = f"{me}-{time.time_ns()}"
        asked = time.perf_counter()
        started = time.time() - float(os.environ.get(LATE) or time.time())  # the launcher's time of its start
        self.store.set(f"join/{me}", token)
        self._get(f"ring/admitted/{token}")
        admitted = time.perf_counter()
        self.ctx.admitted()  # from now on a drop of this rank is a drop, not the one it replaces
        self.done = -1  # behind every member: the front sends its state (_agree)
        self._regroup()
        self.healed_s = {"start_s": started, "wait_s": admitted - asked, "adopt_s": time.perf_counter() - admitted}
        self.store.set(f"ring/healed/{token}", ",".join(f"{v:.4f}" for v in self.healed_s.values()))

    def _get(self, key: str) -> str:
        """A key of the store, waited for as long as it takes (a member one collective behind; a replacement
        while the chief trains), while this member is not dropped and the front not done."""
        try:
            while not self.store.check([key]):
                if self._finished(self.workers):
                    raise Finished
                time.sleep(HEARTBEAT_S / 5)
            return self.store.get(key).decode()
        except (RuntimeError, OSError):  # the store closed: rank 0, which serves it, ended (or was lost, which
            raise Finished from None    # its launcher tells) before this replacement was admitted

    def _send_state(self, root: int, behind: bool) -> None:
        """The front member `root`'s state, with its last small result, to every member; those behind take it."""
        me = self.members.index(self.ctx.rank)
        data = b""
        if me == root:
            buf = io.BytesIO()
            torch.save({"state": self.state(), "last": self.last, "done": self.done}, buf)
            data = buf.getvalue()
        size = torch.tensor([len(data)], dtype=torch.int64)
        self._run(self.pg.broadcast, [size], dist.BroadcastOptions(), rootRank=root, rootTensor=0)
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8) if me == root else \
            torch.empty(int(size), dtype=torch.uint8)
        self._run(self.pg.broadcast, [payload], dist.BroadcastOptions(), rootRank=root, rootTensor=0)
        if behind:
            got = torch.load(io.BytesIO(payload.numpy().tobytes()), map_location="cpu")  # adopt copies to the device
            self.adopt(got["state"])
            self.last, self.done = got["last"], got["done"]
