"""Event simulation of the parameter-server strategies and of async-allreduce, on simpy.

The same costs as costs.py, played out in time, for what the closed forms
cannot do: asynchronous shards (staleness), backup workers (dropped
gradients) and uneven replica speeds (stragglers).

- A pusher (a node's leader, or every replica under async) loops: its
  replicas compute (each at compute_s x a random factor of mean 1 and
  coefficient of variation `spread`, then strategy.slow_delay_s of sleep on
  the slow node; a node waits for its slowest replica), average inside the node, send
  each shard its slice, wait for every shard's reply, share the values inside
  the node. With background loaders a pusher's replicas start a step no
  sooner than the loaders' time for one batch after they started the last
  (costs.loader_floor); that wait counts as computing.
- A transfer between nodes uses the sender's outgoing and the receiver's
  incoming link, and the transfers on a link share it evenly, as TCP flows
  share a bottleneck: each moves at its busier link's share (net_bandwidth
  over the transfers on it), recomputed whenever one starts or ends
  (_Links); then latency passes. Three pushers sending to one shard at once
  all finish at 3x one transfer's time, not one after another. Between
  processes of one node a transfer takes bytes / local_bandwidth, no link.
- A shard serves messages one at a time in arrival order. Async: a gradient
  costs bytes / ps_apply_rate of CPU, is applied at once, and the sender gets
  the new version. Sync: a gradient of the current version costs bytes /
  ps_accumulate_rate (summed into the accumulator); once `wait_for` are in,
  one update (the mean, then the optimizer: costs.sync_update_s) and all
  contributors get the new version; a gradient of an older version is
  dropped and its sender gets the current values (its images are not the
  job's progress, as a run's images_applied leaves them out). scaletrain's
  shard (ps_overlap false) takes a push's header when it is free, receives
  the gradient while it works, and sends its replies itself, one after
  another, as part of its busy time; a threaded one (true) works while every
  message moves.
- A pusher copies its gradient into its messages before pushing and the
  values back from the replies after the pull (host_copy_bandwidth; device
  to host on a GPU, a memory copy, holding a core, on a shared host).
- async-allreduce (Setup.rounds): every replica loops computing (as a pusher's
  replicas do) and adding its gradient into its sum (bytes / ps_accumulate_rate
  of CPU). At the end of a step, if the round it joined is over, it applies
  the round's update (optimizer_s) and joins the next round with the gradients
  it summed since it last joined (at its first step it joins round 0). A round's
  ring (costs.ring_allreduce_s) starts once every replica has joined; on a
  shared host every replica's part of it holds a core. A gradient computed on
  the values of update v and carried by round j is applied j - v updates late.
- On a shared host every piece of work (compute unless compute_on_cores is
  false, averaging, copies, a shard's CPU) holds one of the host's cores
  while it runs; background loaders hold none (see costs.shared_floor).
"""

from __future__ import annotations

import math
import random
from collections import Counter, defaultdict
from dataclasses import dataclass

import simpy

from .costs import host_copy_s, intra_average_s, intra_broadcast_s, loader_floor, replicas_ring_s, sync_update_s
from .profile import Profile
from .setup import Setup


@dataclass
class SimResult:
    images_per_sec: float
    step_s: float                    # mean seconds between two steps of a pusher
    compute_s: float                 # mean seconds a pusher's replicas compute (or wait for data) per step
    intra_s: float                   # seconds per step averaging and sharing inside the node
    staleness_mean: float
    staleness_p95: float             # 95th percentile of the applied gradients' staleness
    dropped_fraction: float          # gradients dropped (too late) over gradients sent
    ps_cpu_util: float               # busiest shard's CPU busy fraction
    link_util: float                 # busiest network link's busy fraction
    link_bytes: dict[str, float]     # bytes each node's link sends per pusher step (and receives)
    gradients_per_update: float = 0.0  # async-allreduce: mean gradients a round's update averages


class _Links:
    """The links between nodes, each (node, "out" | "in") of `bandwidth` bytes/s, shared evenly by the
    transfers on it: a transfer moves at its busier link's share, recomputed at every start and end."""

    def __init__(self, env: simpy.Environment, bandwidth: float) -> None:
        self.env, self.bandwidth = env, bandwidth
        self.flows: list[list] = []  # [bytes left, its two links, the event its end triggers, its rate]
        self.on: Counter = Counter()  # transfers on each link
        self.busy: dict = defaultdict(float)
        self.last, self.wakeups = 0.0, 0

    def send(self, links: tuple, nbytes: float) -> simpy.Event:
        """An event triggered once `nbytes` crossed `links` (the sender's "out", the receiver's "in")."""
        self._advance()
        done = self.env.event()
        self.flows.append([nbytes, links, done, 0.0])
        self.on.update(links)
        self._share()
        self._next()
        return done

    def _share(self) -> None:
        on, bw = self.on, self.bandwidth
        for f in self.flows:
            a, b = f[1]
            f[3] = bw / max(on[a], on[b])

    def _advance(self) -> None:
        dt, self.last = self.env.now - self.last, self.env.now
        if dt > 0 and self.flows:
            for f in self.flows:
                f[0] -= f[3] * dt
            for link, n in self.on.items():
                if n:
                    self.busy[link] += dt

    def _next(self) -> None:
        """End the transfers that are through, then wake at the next end. Through: at most a nanosecond
        left, or less than the clock can still add at this time (a few of its last digits' worth: far
        into a simulation a wake sooner than that would land on the same instant, for ever)."""
        left = max(1e-9, 4 * math.ulp(self.env.now))
        through = [f for f in self.flows if f[0] <= f[3] * left]
        for f in through:
            self.flows.remove(f)
            self.on.subtract(f[1])
            f[2].succeed()
        if through:
            self._share()
        if self.flows:
            self.wakeups += 1
            wake, wakeup = self.env.timeout(min(f[0] / f[3] for f in self.flows)), self.wakeups
            wake.callbacks.append(lambda _: self._wake(wakeup))

    def _wake(self, wakeup: int) -> None:
        if wakeup == self.wakeups:  # else a start or an end since has set a later one
            self._advance()
            self._next()


class _Sim:
    def __init__(self, p: Profile, st: Setup, spread: float, seed: int) -> None:
        self.p, self.st, self.env = p, st, simpy.Environment()
        self.rng = random.Random(seed)
        self.sigma = math.sqrt(math.log1p(spread ** 2))
        self.cores = simpy.Resource(self.env, p.shared_cores) if p.shared_cores else None
        self.links = _Links(self.env, p.net_bandwidth)
        self.queues = [simpy.Store(self.env) for _ in st.shard_bytes]
        self.version = [0] * len(st.shard_bytes)
        self.busy = self.links.busy  # seconds: a link's while it carries a transfer, a shard's while it works
        self.moved: dict[int, float] = defaultdict(float)
        self.done: list[tuple[float, int]] = []   # (time, images) of each pusher step
        self.computing = 0.0
        self.stale: list[int] = []
        self.dropped = self.sent = 0
        self.rounds: list[list[int]] = []     # async-allreduce: per round, the versions of its gradients
        self.joined: list[int] = []           # replicas that joined each round
        self.over: list[simpy.Event] = []     # each round's ring is done

    def factor(self) -> float:
        return self.rng.lognormvariate(-self.sigma ** 2 / 2, self.sigma) if self.sigma else 1.0

    def work(self, seconds: float):
        """CPU or device work of one process; on a shared host it needs a free core."""
        if self.cores is None:
            yield self.env.timeout(seconds)
            return
        with self.cores.request() as req:
            yield req
            yield self.env.timeout(seconds)
            self.busy["host", "cores"] += seconds

    def compute(self, seconds: float, delay: float = 0.0):
        """A replica's forward and backward: CPU work, unless it runs elsewhere (compute_on_cores);
        then a slowed node's delay, which holds no core (it sleeps)."""
        if self.p.compute_on_cores:
            yield from self.work(seconds)
        else:
            yield self.env.timeout(seconds)
        if delay:
            yield self.env.timeout(delay)

    def on_node(self, seconds: float, processes: int):
        """The same work done by `processes` processes of one node at once."""
        if self.cores is None or processes == 1:
            yield from self.work(seconds)
        else:
            yield self.env.all_of([self.env.process(self.work(seconds)) for _ in range(processes)])

    def transfer(self, a: int, b: int, nbytes: int):
        p = self.p
        if a == b or self.cores is not None:  # loopback: a memory copy, CPU work
            yield from self.work(nbytes / p.local_bandwidth + (p.net_latency if a != b else 0.0))
            return
        yield self.links.send(((a, "out"), (b, "in")), nbytes)
        self.moved[a] += nbytes  # sent; what a node receives mirrors it over a push and its reply
        yield self.env.timeout(p.net_latency)

    def pusher(self, i: int):
        p, st, env = self.p, self.st, self.env
        node, reps = st.pusher_node(i), st.pusher_replicas
        seen = [0] * len(st.shard_bytes)
        intra = intra_average_s(p, st) if st.per_node else 0.0
        share = intra_broadcast_s(p, st) if st.per_node else 0.0
        feed, ready = loader_floor(p, st), 0.0
        copy = host_copy_s(p)
        while True:
            slow = st.slow_delay_s if node == st.slow_node else 0.0
            times = [p.compute_s * self.factor() for _ in range(reps)]
            t0 = env.now
            if env.now < ready:  # the loaders have not filled the next batch yet
                yield env.timeout(ready - env.now)
            ready = env.now + feed
            yield env.all_of([env.process(self.compute(t, slow)) for t in times])
            self.computing += env.now - t0
            if copy:  # the gradient into the messages (from the device to the host on a GPU)
                yield from self.work(copy)
            if intra:
                yield from self.on_node(intra, reps)
            pushes = [env.process(self.push(node, k, seen[k])) for k in range(len(seen))]
            got = yield env.all_of(pushes)
            seen = [got[e][0] for e in pushes]
            applied = got[pushes[0]][1]  # a dropped gradient adds no images to the job's progress
            if copy:  # the new values out of the replies (back to the device)
                yield from self.work(copy)
            if share:
                yield from self.on_node(share, reps)
            self.done.append((env.now, reps * p.batch_per_replica if applied else 0))

    def push(self, node: int, k: int, version: int):
        """One shard's part of a push-pull: the gradient's slice in, the shard's values back; gives
        the shard's version and whether the gradient was applied (not dropped as too late)."""
        nbytes, ps, reply = self.st.shard_bytes[k], self.st.ps_nodes[k], self.env.event()
        if not self.p.ps_overlap:  # the shard asks for the gradient when it is free and sends the reply itself
            self.queues[k].put(("header", version, reply, node))
            return (yield reply)
        yield from self.transfer(node, ps, nbytes)
        self.queues[k].put(("in", version, reply, node))
        new = yield reply
        yield from self.transfer(ps, node, nbytes)
        return new

    def receive(self, k: int, version: int, reply, node: int):
        """A gradient scaletrain's shard asked for: it comes in while the shard works."""
        yield from self.transfer(node, self.st.ps_nodes[k], self.st.shard_bytes[k])
        self.queues[k].put(("in", version, reply, node))

    def shard(self, k: int):
        """Messages in arrival order. scaletrain's shard (not ps_overlap) takes a push's header when
        it is free, then receives its gradient while it works, and sends each reply itself, so its
        replies count as its busy time."""
        st, p, env = self.st, self.p, self.env
        nbytes, ps, serial = st.shard_bytes[k], st.ps_nodes[k], not p.ps_overlap
        pending: list = []

        def busy(moves):  # the shard's thread at work: a transfer or CPU work
            t0 = env.now
            yield from moves
            self.busy["ps", k] += env.now - t0

        def answer(replies, applied=True):
            for reply, node in replies:
                if serial:
                    yield from busy(self.transfer(ps, node, nbytes))
                reply.succeed((self.version[k], applied))

        while True:
            kind, version, reply, node = yield self.queues[k].get()
            if kind == "header":
                env.process(self.receive(k, version, reply, node))
                continue
            self.sent += 1
            if not st.sync:
                yield from busy(self.work(nbytes / p.ps_apply_rate))
                self.stale.append(self.version[k] - version)
                self.version[k] += 1
                yield from answer([(reply, node)])
            elif version == self.version[k]:  # summed into the accumulator; applied once all are in
                yield from busy(self.work(nbytes / p.ps_accumulate_rate))
                pending.append((reply, node))
                if len(pending) >= st.wait_for:
                    yield from busy(self.work(sync_update_s(p, nbytes)))
                    self.version[k] += 1
                    self.stale += [0] * len(pending)
                    done, pending = pending, []
                    yield from answer(done)
            else:  # computed on a version already applied: too late
                self.dropped += 1
                yield from answer([(reply, node)], applied=False)

    def replica(self, i: int):
        """An async-allreduce replica (see the module doc)."""
        p, st, env = self.p, self.st, self.env
        slow = st.slow_delay_s if i // st.replicas == st.slow_node else 0.0
        add, version, carried, joined = p.gradient_bytes / p.ps_accumulate_rate, 0, [], -1
        while True:
            t0 = env.now
            yield from self.compute(p.compute_s * self.factor(), slow)
            self.computing += env.now - t0
            yield from self.work(add)
            carried.append(version)
            if st.nodes * st.replicas == 1:  # no ring: each gradient applied at once
                yield from self.work(p.optimizer_s)
                self.rounds.append(carried)
                self.stale.append(0)
                self.done.append((env.now, p.batch_per_replica))
                version, carried = version + 1, []
                continue
            if joined >= 0 and not self.over[joined].triggered:
                continue  # the round is in flight: step on
            if joined >= 0:
                yield from self.work(p.optimizer_s)
                version += 1
            joined += 1
            self.join(joined, carried)
            carried = []

    def join(self, j: int, carried: list[int]):
        st = self.st
        n = st.nodes * st.replicas
        if j == len(self.rounds):
            self.rounds.append([])
            self.joined.append(0)
            self.over.append(self.env.event())
        self.rounds[j] += carried
        self.joined[j] += 1
        if self.joined[j] == n:
            self.env.process(self.ring(j, n))

    def ring(self, j: int, n: int):
        p = self.p
        yield from self.on_node(replicas_ring_s(p, self.st), n)
        self.stale += [j - v for v in self.rounds[j]]
        self.done.append((self.env.now, len(self.rounds[j]) * p.batch_per_replica))
        self.over[j].succeed()


def simulate(p: Profile, st: Setup, *, spread: float = 0.0, seed: int = 0, cycle_hint: float = 1.0,
             cycles: int = 0) -> SimResult:
    """Run `cycles` of about `cycle_hint` seconds (the closed form's step); the first tenth
    is left out of the rates, as a bench leaves out its warm-up steps. By default the
    cycles shrink from 300 as pushers x shards grow (the samples per cycle grow with them),
    to no fewer than 40."""
    cycles = cycles or max(40, min(300, 20_000 // max(1, st.pushers * len(st.shard_bytes))))
    sim = _Sim(p, st, spread, seed)
    for k in range(len(st.shard_bytes)):
        sim.env.process(sim.shard(k))
    actors = st.nodes * st.replicas if st.rounds else st.pushers  # replicas, or pushers
    for i in range(actors):
        sim.env.process(sim.replica(i) if st.rounds else sim.pusher(i))
    horizon = cycles * cycle_hint
    sim.env.run(until=horizon)
    start = horizon / 10
    kept = [img for t, img in sim.done if t >= start]
    steps = len(sim.done) / (1 if st.rounds else st.pushers)
    if not kept or steps < 2:
        raise RuntimeError(f"simulation made {steps:.1f} steps per pusher in {horizon:.3g} s; raise cycles")
    images_per_sec = sum(kept) / (horizon - start)
    return SimResult(
        images_per_sec=images_per_sec,
        step_s=st.nodes * st.replicas * p.batch_per_replica / images_per_sec if st.rounds else
        st.pushers * (horizon - start) / len(kept),
        compute_s=sim.computing / len(sim.done),
        intra_s=(intra_average_s(p, st) + intra_broadcast_s(p, st)) if st.per_node else 0.0,
        staleness_mean=sum(sim.stale) / len(sim.stale) if sim.stale else 0.0,
        staleness_p95=float(sorted(sim.stale)[math.ceil(0.95 * len(sim.stale)) - 1]) if sim.stale else 0.0,
        dropped_fraction=sim.dropped / sim.sent if sim.sent else 0.0,
        ps_cpu_util=max((sim.busy["ps", k] / horizon for k in range(len(st.shard_bytes))), default=0.0),
        link_util=max((v / horizon for key, v in sim.busy.items() if key[1] in ("out", "in")), default=0.0),
        link_bytes={f"node {n + 1}": b / steps for n, b in sorted(sim.moved.items())},
        gradients_per_update=sum(len(r) for r in sim.rounds[:len(sim.done)]) / len(sim.done) if st.rounds else 0.0,
    )
