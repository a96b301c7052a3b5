"""The twin's link self-test: what rate its links really deliver, against the rate set.

Every node sends to the next, in a ring (1 -> 2 -> ... -> N -> 1), over the job's own transport
(torch.distributed, gloo: probe.py), all at once for about a second: every link carries the rate
both ways, as in a ring all-reduce, the heaviest load a job puts on the twin, and this machine's
CPUs carry all of it through the kernel. The rate each pair sees is the payload's, and tbf counts
frames: at most FRAMING of a link's rate is payload (TCP's 1448 bytes with timestamps in a
1514-byte Ethernet frame). A link that delivers at least 90% of that is one that works; below,
something else limits (the CPUs): the twin would report this machine, not the network set, and is
refused; a time scale (cluster.time_scale) slows its links to a rate it can carry. A round that falls
short is measured again, up to ROUNDS in all: a host busy for a moment (another process's burst, a
stall of the virtual machine) costs a second of one round, where a twin its CPUs cannot carry falls
short in every round; the best round is the one reported.
"""

from __future__ import annotations

import json
import math
import os
import select
import signal
import time

from ..errors import LaunchError
from . import probe
from .netns import Twin, address

ROUNDS = 3  # measures of every link before a twin is refused
TOLERANCE = 0.9  # the delivered payload, at least this fraction of the most a link of the set rate carries
FRAMING = 1448 / 1514  # payload per frame: TCP with timestamps in a 1500-byte MTU, and the Ethernet header
CHUNK = 4 << 20  # bytes a send
PORT = 29400
WAIT_S = 60.0  # for the probes to start and meet, and for their data beyond its expected time


def pairs(nodes: int) -> list[tuple[int, int]]:
    """(sender, receiver) nodes: a ring, so that every node's link is used both ways at once."""
    return [(k, (k + 1) % nodes) for k in range(nodes)] if nodes > 1 else []


def measure(twin: Twin, between: list[tuple[int, int]] | None = None, seconds: float = 1.0) -> list[float]:
    """Gbit/s of payload each (src, dst) pair delivers while all send at once (default: pairs())."""
    between = between or pairs(twin.nodes)
    probes = []  # (pair, pid, lines, go): a sender and a receiver a pair
    try:
        for src, dst in between:
            rate = min(twin.gbps[src], twin.gbps[dst]) * 1e9 / 8
            chunks = 1 + max(2, math.ceil(rate * seconds / CHUNK))
            for rank, node in ((0, src), (1, dst)):
                pid, up, down = probe.fork(twin.node_ns(node), rank, address(src), PORT, CHUNK, chunks)
                probes.append(((src, dst), pid, os.fdopen(up), os.fdopen(down, "w")))
        deadline = time.monotonic() + WAIT_S
        for pair, _, lines, _ in probes:  # each says `ready` once it met its peer
            _expect(lines, "ready", pair, deadline)
        for *_, go in probes:
            go.write("go\n")
            go.flush()
        deadline = time.monotonic() + WAIT_S + 4 * seconds
        got = [json.loads(_expect(lines, "{", pair, deadline)) for pair, _, lines, _ in probes]
    finally:
        for _, pid, lines, go in probes:
            for f in (lines, go):
                try:
                    f.close()
                except OSError:  # a probe that died: its end of the pipe is gone
                    pass
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(pid, 0)
    return [g["bytes"] * 8 / g["seconds"] / 1e9 for g in got[1::2]]


def _expect(lines, start: str, pair: tuple[int, int], deadline: float) -> str:
    """The probe's next line, which must start with `start`; LaunchError naming the pair otherwise."""
    src, dst = pair
    where = f"the cluster twin's link self-test between nodes {src + 1} and {dst + 1}"
    ready, _, _ = select.select([lines], [], [], max(0.0, deadline - time.monotonic()))
    line = lines.readline().strip() if ready else None
    if line is None:
        raise LaunchError(f"{where}: no answer in {WAIT_S:.0f} s (no data crossed)")
    if not line.startswith(start):
        raise LaunchError(f"{where} failed: {line.removeprefix('error ') or 'the probe ended'}")
    return line


def check(twin: Twin, seconds: float = 1.0, rounds: int = ROUNDS) -> dict:
    """Measure every node's link at once and refuse a twin that does not carry its own rates in any of
    `rounds` rounds (one node: nothing to test, {}). Returns the best round's {pairs, set_gbps,
    measured_gbps, ratio, of_payload_rate, rounds}: its worst pair's measured rate over its set rate, and
    over the most payload that rate carries; and the rounds it took."""
    if twin.nodes < 2:
        return {}
    between = pairs(twin.nodes)
    want = [min(twin.gbps[s], twin.gbps[d]) for s, d in between]
    best, rounds = None, max(1, rounds)
    for k in range(1, rounds + 1):
        got = measure(twin, between, seconds)
        worst = min(range(len(got)), key=lambda i: got[i] / want[i])
        out = {"pairs": [[s + 1, d + 1] for s, d in between], "set_gbps": want, "measured_gbps": got,
               "ratio": got[worst] / want[worst], "of_payload_rate": got[worst] / (want[worst] * FRAMING), "rounds": k}
        if best is None or out["of_payload_rate"] > best[0]["of_payload_rate"]:
            best = out, worst
        if out["of_payload_rate"] >= TOLERANCE:
            return out
    out, worst = best
    scale = math.ceil(1 / out["of_payload_rate"] / TOLERANCE)
    (s, d), got = between[worst], out["measured_gbps"][worst]
    raise LaunchError(f"the cluster twin delivers {got:.3g} of the {want[worst]:.3g} Gbit/s set from node {s + 1} "
                      f"to node {d + 1} while every link is in use ({rounds} rounds, the best given): this machine's "
                      f"CPUs, not the links, would limit the job; set cluster.time_scale {scale}x higher (or more) so "
                      "that its links run at a rate it can carry")
