"""The twin's link self-test: what rate its links really deliver, against the rate set.

Two processes, in two nodes' namespaces, move data over the job's own transport (torch.distributed,
gloo, probe.py) for about a second. The rate they see is the payload's: the rate set counts
frames, whose headers take some 4% of a 1500-byte frame, so a delivered rate within 10% of the set
one is a link that works. Below 90%, something else limits (the machine's CPUs, which carry every
emulated node's traffic through the kernel): the twin would report its CPUs, not the network
set, and is refused; a time scale (cluster.time_scale) slows its links to a rate it can carry.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from functools import partial

from ..errors import LaunchError
from .netns import IFNAME, Twin, address, enter

TOLERANCE = 0.9  # the delivered rate, at least this fraction of the set one
CHUNK = 4 << 20  # bytes a send
PORT = 29400


def measure(twin: Twin, src: int = 0, dst: int = 1, seconds: float = 1.0) -> float:
    """Gbit/s of payload from node src to node dst, sent for about `seconds` at the set rate."""
    rate = min(twin.gbps[src], twin.gbps[dst]) * 1e9 / 8
    chunks = 1 + max(2, math.ceil(rate * seconds / CHUNK))
    procs = [subprocess.Popen([sys.executable, "-m", "scaletrain.twin.probe", str(rank), address(src), str(PORT),
                               str(CHUNK), str(chunks)], env=dict(os.environ, GLOO_SOCKET_IFNAME=IFNAME), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              preexec_fn=partial(enter, twin.node_ns(node)))
             for rank, node in ((0, src), (1, dst))]
    try:
        outs = [p.communicate(timeout=60 + 4 * seconds) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise LaunchError(f"the cluster twin's link self-test: no data crossed from node {src + 1} to node "
                          f"{dst + 1} in {60 + 4 * seconds:.0f} s") from None
    if any(p.returncode for p in procs):
        err = next(e for (_, e), p in zip(outs, procs) if p.returncode).strip().splitlines()
        raise LaunchError(f"the cluster twin's link self-test failed: {err[-1] if err else 'no message'}")
    got = json.loads(outs[1][0])
    return got["bytes"] * 8 / got["seconds"] / 1e9


def check(twin: Twin, seconds: float = 1.0) -> dict:
    """Measure node 1 -> node 2's link (node 1 alone: nothing to test) and refuse a twin that does not
    carry its own rate. Returns {set_gbps, measured_gbps, ratio}."""
    if twin.nodes < 2:
        return {}
    got = measure(twin, 0, 1, seconds)
    want = min(twin.gbps[0], twin.gbps[1])
    out = {"set_gbps": want, "measured_gbps": got, "ratio": got / want}
    if got < TOLERANCE * want:
        scale = math.ceil(want / got / TOLERANCE)
        raise LaunchError(f"the cluster twin delivers {got:.3g} of the {want:.3g} Gbit/s set between two nodes: this "
                          f"machine's CPUs, not the link, would limit the job; set cluster.time_scale = {scale} (or more) "
                          "so that its links run at a rate it can carry")
    return out
