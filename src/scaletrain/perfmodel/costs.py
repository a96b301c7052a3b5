"""Closed-form costs: all-reduce, intra-node averaging and the synchronous PS step.

The cost of moving n bytes in one message is latency + n / bandwidth (the
alpha-beta model). A node's network link carries bytes out and in at once,
each at `net_bandwidth`; a transfer between two processes of one node (a PS
alongside its node's worker) uses `local_bandwidth` and no network link. A
synchronous PS shard adds each gradient into an accumulator (bytes /
`ps_accumulate_rate` of CPU) and applies one update per version: the sum's
mean (one more pass at that rate) and the optimizer (bytes /
`ps_apply_rate`), as TensorFlow's synchronous replicas and scaletrain's
server both do; an asynchronous one applies every gradient. scaletrain's shard
asks for a gradient once it is free, receives it while it works, and sends its
replies itself, one after another.
These formulas assume every replica runs at the same speed; uneven speeds,
backups and asynchronous shards go to the event simulation (simulate.py).
On a shared host (profile.shared_cores > 0) every process's work competes
for the same cores; a step is then at least its total CPU work / cores.
Background loaders (data.workers > 0) fill each replica's next batch while it
computes and communicates: a step lasts at least the time they take
(loader_floor). Loading in the training process is in series with compute:
predict.estimate adds it to compute_s before these formulas run.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

from .profile import Profile
from .setup import Setup


def ring_allreduce_s(n: int, nbytes: float, bandwidth: float, latency: float) -> float:
    """Ring all-reduce of nbytes over n processes: 2(n-1) steps, each moving nbytes/n."""
    return 0.0 if n <= 1 else 2 * (n - 1) * (latency + nbytes / (n * bandwidth))


def broadcast_s(n: int, nbytes: float, bandwidth: float, latency: float) -> float:
    """Broadcast from one process to n-1 others along a binomial tree, pipelined by chunks."""
    return 0.0 if n <= 1 else math.ceil(math.log2(n)) * latency + nbytes / bandwidth


@dataclass
class Estimate:
    """A configuration's predicted step: the time of one pusher cycle and where it goes."""

    step_s: float                        # seconds between two steps of one replica
    images_per_step: int                 # images all replicas process in one step
    parts: dict[str, float]              # seconds of the step by activity
    ps_cpu_util: float = 0.0             # busiest PS's CPU busy fraction
    link_util: float = 0.0               # busiest network link's busy fraction
    link_bytes: dict[str, float] = field(default_factory=dict)  # bytes each node's link sends per step
    staleness_mean: float | None = None
    staleness_p95: float | None = None
    dropped_fraction: float = 0.0
    straggler_s: float = 0.0
    gradients_per_update: float = 0.0    # async-allreduce: gradients one update averages (a mean)

    @property
    def images_per_sec(self) -> float:
        return self.images_per_step / self.step_s


def intra_average_s(p: Profile, st: Setup) -> float:
    """Averaging the replicas' gradients inside a node before its push."""
    return ring_allreduce_s(st.replicas, p.gradient_bytes, p.intra_bandwidth, p.intra_latency)


def intra_broadcast_s(p: Profile, st: Setup) -> float:
    """The node's leader sharing the new parameters with its other replicas after the pull.
    On a shared host the copies go one way through loopback, at the point-to-point rate."""
    bw = p.local_bandwidth if p.shared_cores else p.intra_bandwidth
    return broadcast_s(st.replicas, p.gradient_bytes, bw, p.intra_latency)


def shared_floor(p: Profile, cpu_s: float) -> float:
    """On a shared host a step lasts at least the CPU work of all its processes over the cores."""
    # Background loaders are left out of cpu_s: on a shared host they take cores from compute, so
    # the step comes out short while they are busy (not modelled yet, though calibrate measures
    # input_rate for recipes read from files). Loading done by the training process counts, in compute_s.
    return cpu_s / p.shared_cores if p.shared_cores else 0.0


def input_s(p: Profile, st: Setup) -> float:
    """Seconds of input (read, decode, augment) per step of one replica: its batch over its
    loader cores at once, or over the training process's own core when it has none; and at least
    the job's images of a step over what the shared file system delivers to all its nodes."""
    decode = p.batch_per_replica / (p.input_rate * max(1, st.loaders)) if p.input_rate else 0.0
    read = p.batch_per_replica * st.nodes * st.replicas / p.read_rate if p.read_rate else 0.0
    return max(decode, read)


def loader_floor(p: Profile, st: Setup) -> float:
    """The least step background loaders allow: they overlap the whole step, not only compute."""
    return input_s(p, st) if st.loaders else 0.0


def replicas_ring_s(p: Profile, st: Setup) -> float:
    """One ring all-reduce of the gradient over every replica. Its pace is that of its slowest
    hop: a network hop once it spans nodes; within one node, or with every "node" on one host,
    none."""
    if st.nodes == 1 or p.shared_cores:
        bw, lat = p.intra_bandwidth, p.intra_latency
    else:
        bw, lat = p.net_bandwidth, p.net_latency
    return ring_allreduce_s(st.nodes * st.replicas, p.gradient_bytes, bw, lat)


def allreduce(p: Profile, st: Setup, wait: float = 0.0) -> Estimate:
    """All-reduce: each replica computes, joins one ring over all replicas, steps its optimizer.
    The ring's pace is that of its slowest hop: a network hop once it spans nodes. `wait`: the
    seconds the ring waits for its slowest replica (a straggler), which keeps no core busy.
    Local steps (st.sync_every = H > 1: local-sgd, diloco) join the ring once in H steps, with the
    weights' bytes (the gradient's), and diloco steps its outer optimizer there: a step carries 1/H
    of each. A replica's k-th step after a meeting misses the others' last k: staleness 0..H-1."""
    n, h = st.nodes * st.replicas, st.sync_every
    comm = replicas_ring_s(p, st) / h
    parts = {"compute": p.compute_s, "network" if st.nodes > 1 else "intra-node": comm,
             "optimizer": p.optimizer_s * (1 + st.outer / h)}
    cpu = n * (sum(parts.values()) - (0.0 if p.compute_on_cores else p.compute_s))
    step = max(sum(parts.values()) + wait, shared_floor(p, cpu), loader_floor(p, st))
    moved = 2 * (n - 1) / n * p.gradient_bytes / h if n > 1 else 0.0
    links = {f"node {k + 1}": moved for k in range(st.nodes)} if st.nodes > 1 else {}  # one ring hop leaves each node
    est = Estimate(step, n * p.batch_per_replica, parts, link_bytes=links, straggler_s=wait,
                   staleness_mean=(h - 1) / 2 if h > 1 else None, staleness_p95=math.ceil(0.95 * h) - 1 if h > 1 else None)
    est.link_util = max((b / p.net_bandwidth / step for b in links.values()), default=0.0)
    return est


def pipeline_allreduce(p: Profile, st: Setup) -> Estimate:
    """All-reduce of replicas split into st.stages pipeline stages (parallel.stages), M micro-batches.

    A stage computes 1/S of a replica's forward and backward of each micro-batch (a split that
    balances compute: what parallel.balance = time aims at), compute_at(batch / M) / S, and sends
    each micro-batch's activations to the next stage and their gradient back, st.boundary_bytes an
    image at intra_bandwidth. A schedule (GPipe or 1F1B alike) takes M + S - 1 such slots: the
    S - 1 more are the bubble, each stage idle for (S - 1) / (M + S - 1) of them. Then each stage's
    replicas all-reduce its 1/S of the gradient, every stage at once: inside a node each ring on
    its own devices; across nodes the S rings share the node's link, which carries the whole
    gradient's bytes, as one ring would. Each stage steps its 1/S of the optimizer."""
    s, m = st.stages, st.microbatches
    mb = p.batch_per_replica / m
    slot = (p.compute_base_s + (p.compute_s - p.compute_base_s) * mb / p.batch_per_replica) / s
    act = 2 * (p.intra_latency + mb * st.boundary_bytes / p.intra_bandwidth)  # one way, then back
    n = st.nodes * st.replicas
    if st.nodes == 1 or p.shared_cores:
        comm = ring_allreduce_s(n, p.gradient_bytes / s, p.intra_bandwidth, p.intra_latency)
    else:
        comm = ring_allreduce_s(n, p.gradient_bytes, p.net_bandwidth, p.net_latency)
    parts = {"compute": m * slot, "bubble": (s - 1) * slot, "activations": (m + s - 1) * act,
             "network" if st.nodes > 1 else "intra-node": comm, "optimizer": p.optimizer_s / s}
    step = max(sum(parts.values()), loader_floor(p, st))
    moved = 2 * (n - 1) / n * p.gradient_bytes if n > 1 else 0.0
    links = {f"node {k + 1}": moved for k in range(st.nodes)} if st.nodes > 1 else {}
    est = Estimate(step, n * p.batch_per_replica, parts, link_bytes=links)
    est.link_util = max((b / p.net_bandwidth / step for b in links.values()), default=0.0)
    return est


def async_allreduce(p: Profile, st: Setup) -> Estimate:
    """Async-allreduce: each replica computes, adds its gradient into its sum (one pass at
    ps_accumulate_rate) and steps on; one ring at a time averages the sums in the background.
    A round starts at a replica's step and is seen at the first step that ends after the ring:
    it lasts a whole number of steps, at least one, and its update (one optimizer step) averages
    that many gradients of every replica. In steady state every gradient is applied one update
    after the values it was computed on (the next round's). On a shared host the rings and
    updates take cores too: the step lasts at least all that CPU work over the cores. A slowed
    node (strategy.slow_delay_s a step) holds no one back: its replicas add fewer gradients,
    and step_s is the mean step that gives the job's images per second. strategy.async_bound
    is not modelled."""
    n = st.nodes * st.replicas
    comm = replicas_ring_s(p, st)
    add = p.gradient_bytes / p.ps_accumulate_rate
    own = p.compute_s + add
    per_round = max(1, math.ceil(comm / own)) if n > 1 else 1  # steps a round lasts
    step = own + p.optimizer_s / per_round
    cpu = n * ((p.compute_s if p.compute_on_cores else 0.0) + add + (comm + p.optimizer_s) / per_round)
    step = max(step, shared_floor(p, cpu), loader_floor(p, st))
    slow = st.slow_delay_s if st.slow_node >= 0 else 0.0
    slowed = st.replicas if slow else 0
    step = n / ((n - slowed) / step + slowed / (step + slow))
    parts = {"compute": p.compute_s, "accumulate": add, "optimizer": p.optimizer_s / per_round,
             "network" if st.nodes > 1 else "intra-node": 0.0}  # the ring overlaps the steps
    moved = 2 * (n - 1) / n * p.gradient_bytes / per_round if n > 1 else 0.0
    links = {f"node {k + 1}": moved for k in range(st.nodes)} if st.nodes > 1 else {}
    est = Estimate(step, n * p.batch_per_replica, parts, link_bytes=links,
                   staleness_mean=1.0 if n > 1 else 0.0, staleness_p95=1.0 if n > 1 else 0.0)
    est.link_util = max((b / p.net_bandwidth / step for b in links.values()), default=0.0)
    est.gradients_per_update = n * per_round
    return est


def host_copy_s(p: Profile) -> float:
    """A pusher copying its gradient into the messages to its shards, and as much back from the
    replies after the pull: device to host on a GPU, a memory copy on a CPU host."""
    return p.gradient_bytes / p.host_copy_bandwidth if p.host_copy_bandwidth else 0.0


def sync_ps(p: Profile, st: Setup) -> Estimate:
    """Synchronous PS step with equal replicas: compute, average in the node, copy to the host,
    push every shard its slice; each shard sums the gradients into an accumulator as they come
    in and applies one update once all are in; every shard replies to every pusher.

    A threaded shard (ps_overlap) works while messages move: the push and pull phases last
    as long as their busiest link, and the shard's accumulating overlaps the push of later
    gradients, so what is left is its accumulating not hidden behind its own incoming
    transfers (at least one gradient's), then the update. scaletrain's shard sends every reply
    itself (serial_shard_s)."""
    n_push = st.pushers
    out_b, in_b = _phase_bytes(st)
    acc_k = [n_push * s / p.ps_accumulate_rate for s in st.shard_bytes]
    apply_k = [sync_update_s(p, s) for s in st.shard_bytes]
    intra = intra_average_s(p, st) + intra_broadcast_s(p, st)
    parts = {"compute": p.compute_s, "intra-node": intra, "host copies": 2 * host_copy_s(p)}
    if p.ps_overlap:
        push = max((b / p.net_bandwidth for b in (*out_b.values(), *in_b.values())), default=0.0)
        local = max((s / p.local_bandwidth for k, s in enumerate(st.shard_bytes) if _has_local(st, k)), default=0.0)
        lat = p.net_latency if push else 0.0
        incoming_k = [_remote_pushers(st, k) * s / p.net_bandwidth for k, s in enumerate(st.shard_bytes)]
        parts["network"] = 2 * (max(push, local) + lat)
        parts["PS CPU"] = max(max(a - i, a / n_push) + u for a, i, u in zip(acc_k, incoming_k, apply_k))
        ps_busy = [a + u for a, u in zip(acc_k, apply_k)]
    else:
        ahead = sum(parts.values())
        rounds = [serial_shard_s(p, st, k, ahead) for k in range(len(st.shard_bytes))]
        worst = max(range(len(rounds)), key=lambda k: rounds[k][0])
        parts["PS (one thread)"] = rounds[worst][0] - ahead
        ps_busy = [busy for _, busy in rounds]
    moved = 2 * n_push * sum(st.shard_bytes)  # every gradient and every reply, copied once each
    cpu = st.nodes * st.replicas * (p.compute_s * p.compute_on_cores + intra) + sum(acc_k) + sum(apply_k) + \
        moved / p.local_bandwidth + n_push * parts["host copies"]
    step = max(sum(parts.values()), shared_floor(p, cpu), loader_floor(p, st))
    # A node's link sends its pushes and its PS's replies, and receives as much.
    links = {f"node {a + 1}": out_b.get(a, 0.0) + in_b.get(a, 0.0) for a in sorted({*out_b, *in_b})}
    est = Estimate(step, st.nodes * st.replicas * p.batch_per_replica, parts, link_bytes=links,
                   ps_cpu_util=max(ps_busy) / step, staleness_mean=0.0, staleness_p95=0.0)
    est.link_util = max(links.values(), default=0.0) / p.net_bandwidth / step
    return est


def sync_update_s(p: Profile, nbytes: float) -> float:
    """A synchronous shard's update of `nbytes`: the accumulated sum into its mean, then the optimizer."""
    return nbytes / p.ps_accumulate_rate + nbytes / p.ps_apply_rate


def serial_shard_s(p: Profile, st: Setup, k: int, ahead: float) -> tuple[float, float]:
    """(The round of scaletrain's shard k, its busy seconds in it) with pushers that spend `ahead`
    seconds between its reply and their next gradient. After its update the shard sends each reply
    itself, in turn; it takes a push's header once it is free, and the gradient then comes in while
    it works (the communication library's threads receive it), one after another through the PS's
    link; it adds each once it is in, then applies. The pusher answered first computes meanwhile,
    so its gradient may be on its way before the last reply is out when its compute is short."""
    s, n = st.shard_bytes[k], st.pushers
    add = s / p.ps_accumulate_rate
    linked = [st.pusher_node(i) != st.ps_nodes[k] and not p.shared_cores for i in range(n)]
    move = [s / p.net_bandwidth + p.net_latency if linked[i] else
            s / p.local_bandwidth + (p.net_latency if st.pusher_node(i) != st.ps_nodes[k] else 0.0)
            for i in range(n)]
    replied = list(itertools.accumulate(move))  # after the update, each reply in turn
    arrived, link = [], 0.0
    for i in range(n):  # asked for once the replies are out, through the PS's incoming link if it has one
        start = max(replied[i] + ahead, replied[-1])
        if linked[i]:
            start = max(start, link)
            link = start + move[i]
        arrived.append(start + move[i])
    free = replied[-1]
    for t in sorted(arrived):  # the shard adds each once it is in
        free = max(free, t) + add
    return free + sync_update_s(p, s), sum(move) + n * add + sync_update_s(p, s)


def _remote_pushers(st: Setup, k: int) -> int:
    return sum(st.pusher_node(i) != st.ps_nodes[k] for i in range(st.pushers))


def _has_local(st: Setup, k: int) -> bool:
    return _remote_pushers(st, k) < st.pushers


def _phase_bytes(st: Setup) -> tuple[dict[int, float], dict[int, float]]:
    """Bytes each node's link sends and receives during the push phase (the pull mirrors it)."""
    out_b: dict[int, float] = {}
    in_b: dict[int, float] = {}
    for i in range(st.pushers):
        a = st.pusher_node(i)
        for k, s in enumerate(st.shard_bytes):
            b = st.ps_nodes[k]
            if a != b:
                out_b[a] = out_b.get(a, 0.0) + s
                in_b[b] = in_b.get(b, 0.0) + s
    return out_b, in_b
