"""The twin's link self-test: what rate its links really deliver, against the rate set.

Node pairs (1 -> 2, 3 -> 4, ..., and the last node -> 1 where the count is odd) move data over the
job's own transport (torch.distributed, gloo: probe.py) at once for about a second, so every
node's link carries traffic together, as in a ring all-reduce: the machine's CPUs carry all of it
through the kernel. The rate each pair sees is the payload's: the rate set counts frames, whose
headers take some 4% of a 1500-byte frame, so a delivered rate within 10% of the set one is a
link that works. Below 90%, something else limits (the CPUs): the twin would report this
machine, not the network set, and is refused; a time scale (cluster.time_scale) slows its links
to a rate it can carry.
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

TOLERANCE = 0.9  # the delivered rate, at least this fraction of the set one
CHUNK = 4 << 20  # bytes a send
PORT = 29400
WAIT_S = 60.0  # for the probes to start and meet, and for their data beyond its expected time


def pairs(nodes: int) -> list[tuple[int, int]]:
    """(sender, receiver) nodes: every node's link in use once the pairs send at once."""
    out = [(k, k + 1) for k in range(0, nodes - 1, 2)]
    return out + [(nodes - 1, 0)] if nodes % 2 and nodes > 1 else out


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


def check(twin: Twin, seconds: float = 1.0) -> dict:
    """Measure every node's link at once and refuse a twin that does not carry its own rates (one node:
    nothing to test, {}). Returns {pairs, set_gbps, measured_gbps, ratio}: ratio is the worst pair's."""
    if twin.nodes < 2:
        return {}
    between = pairs(twin.nodes)
    got = measure(twin, between, seconds)
    want = [min(twin.gbps[s], twin.gbps[d]) for s, d in between]
    worst = min(range(len(got)), key=lambda i: got[i] / want[i])
    out = {"pairs": [[s + 1, d + 1] for s, d in between], "set_gbps": want, "measured_gbps": got,
           "ratio": got[worst] / want[worst]}
    if out["ratio"] < TOLERANCE:
        scale = math.ceil(1 / out["ratio"] / TOLERANCE)
        s, d = between[worst]
        raise LaunchError(f"the cluster twin delivers {got[worst]:.3g} of the {want[worst]:.3g} Gbit/s set from node "
                          f"{s + 1} to node {d + 1} while every link is in use: this machine's CPUs, not the links, "
                          f"would limit the job; set cluster.time_scale {scale}x higher (or more) so that its links "
                          "run at a rate it can carry")
    return out
