"""The twin's network: one Linux network namespace per emulated node, a hub namespace holding a
bridge, a veth pair from each node to the hub, and tbf shaping on both ends of each pair.

  node k's namespace              the hub's namespace
  lo, twin0 198.18.0.(k+1)/24  <->  n<k> -- br0 -- n<j>  <->  twin0 of node j

Nothing is added to the host's own namespace: the bridge and every address live in namespaces
made here, with no route out and no NAT (198.18.0.0/15 is the range set aside for benchmarking
networks, RFC 2544; in these namespaces it reaches nothing else either way). Node k's upload is
shaped on its twin0 (egress), its download on n<k> in the hub (egress toward it): each direction at
the link's rate. Traffic between the processes of one node goes over its loopback, unshaped, as
over a real node's memory.

What a twin made is recorded before it is made (STATE/<id>.json: the launcher's pid and start
time, the namespaces' names), so a launcher killed with -9 leaves a record the next start, or
`scaletrain twin clean`, acts on: namespaces whose owner is gone are deleted, and deleting a
namespace deletes its interfaces and qdiscs with it. Nothing is touched that a record does not
name. Every change is made with iproute2 (`ip`, `tc`), as root.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import LaunchError

STATE = Path("/run/scaletrain-twin")
NETNS = Path("/run/netns")  # where `ip netns add` mounts a namespace
IFNAME = "twin0"  # a node's interface, the same name in every node's namespace
SUBNET = "198.18.0"  # node k is SUBNET.(k+1)/24
CLONE_NEWNET = 0x40000000
MAX_NODES = 250
_MADE = 0  # twins this process made


def address(node: int) -> str:
    return f"{SUBNET}.{node + 1}"


def tbf(gbps: float) -> list[str]:
    """tbf's arguments for a rate of gbps: a bucket of 2 ms at the rate (at least 64 KiB, so the
    kernel's timer, 1-4 ms a tick, never starves the link) and a queue of 20 ms, beyond which TCP sees
    drops and slows down as it would at a real switch."""
    rate = gbps * 1e9 / 8  # bytes a second
    burst = max(64 * 1024, int(rate * 0.002))
    return ["tbf", "rate", f"{int(gbps * 1e9)}bit", "burst", str(burst), "latency", "20ms"]


def privileges() -> str | None:
    """Why a twin cannot be made here (one line), or None."""
    if os.geteuid() != 0:
        return "cluster.network = netns needs root (network namespaces, veth pairs and tc shaping)"
    missing = [c for c in ("ip", "tc") if shutil.which(c) is None]
    if missing:
        return f"cluster.network = netns needs iproute2's {' and '.join(missing)} (Debian: apt-get install iproute2)"
    return None


def _run(*cmd: str) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise LaunchError(f"the cluster twin: `{' '.join(cmd)}` failed: {(r.stderr or r.stdout).strip()}")


def _start_time(pid: int) -> str | None:
    """A process's start time (clock ticks since boot, /proc/PID/stat field 22): with the pid, it
    names one process, never a later one given the same pid."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[19]
    except (OSError, IndexError):
        return None


@dataclass
class Twin:
    """The network of one job's emulated nodes. Make it with `Twin.make(nodes, gbps)`; `close()`
    (or leaving a `with`) removes everything it made."""

    id: str
    nodes: int
    gbps: list[float]
    namespaces: list[str] = field(default_factory=list)

    @property
    def hub(self) -> str:
        return f"st{self.id}h"

    def node_ns(self, node: int) -> str:
        return f"st{self.id}n{node}"

    def record(self) -> Path:
        return STATE / f"{self.id}.json"

    @classmethod
    def make(cls, nodes: int, gbps: list[float] | float) -> "Twin":
        """The namespaces and links of `nodes` nodes, node k's link shaped to gbps[k] each way.
        Removes first what dead jobs' twins left (clean)."""
        why = privileges()
        if why:
            raise LaunchError(why)
        if not 1 <= nodes <= MAX_NODES:
            raise LaunchError(f"cluster.nodes = {nodes}: the cluster twin holds 1..{MAX_NODES} nodes")
        rates = list(gbps) if isinstance(gbps, list) else [float(gbps)] * nodes
        clean()
        global _MADE
        _MADE += 1  # twins one process makes side by side (the Python API in threads) get names of their own
        twin = cls(f"{os.getpid()}" + (f"x{_MADE}" if _MADE > 1 else ""), nodes, rates)
        twin.namespaces = [twin.hub] + [twin.node_ns(k) for k in range(nodes)]
        STATE.mkdir(parents=True, exist_ok=True)
        twin.record().write_text(json.dumps({"pid": os.getpid(), "start": _start_time(os.getpid()),
                                             "namespaces": twin.namespaces}) + "\n")
        try:
            twin._build()
        except BaseException:
            twin.close()
            raise
        return twin

    def _build(self) -> None:
        hub = self.hub
        for ns in self.namespaces:
            _run("ip", "netns", "add", ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        _run("ip", "-n", hub, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", hub, "link", "set", "br0", "up")
        for k in range(self.nodes):
            ns, end = self.node_ns(k), f"n{k}"
            _run("ip", "-n", hub, "link", "add", end, "type", "veth", "peer", "name", IFNAME, "netns", ns)
            _run("ip", "-n", hub, "link", "set", end, "master", "br0", "up")
            _run("ip", "-n", ns, "addr", "add", f"{address(k)}/24", "dev", IFNAME)
            _run("ip", "-n", ns, "link", "set", IFNAME, "up")
            self.shape(k, self.gbps[k], "add")

    def shape(self, node: int, gbps: float, how: str = "change") -> None:
        """Set node's link to gbps in both directions (mid-run too: a slowed link)."""
        _run("tc", "-n", self.node_ns(node), "qdisc", how, "dev", IFNAME, "root", *tbf(gbps))
        _run("tc", "-n", self.hub, "qdisc", how, "dev", f"n{node}", "root", *tbf(gbps))
        self.gbps[node] = gbps

    def link(self, node: int, up: bool) -> None:
        """Set node's link down (a partition: it reaches no other node) or up again."""
        _run("ip", "-n", self.hub, "link", "set", f"n{node}", "up" if up else "down")

    def close(self) -> None:
        _remove(self.record(), self.namespaces)

    def __enter__(self) -> "Twin":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _remove(record: Path, namespaces: list[str]) -> None:
    for ns in namespaces:
        if (NETNS / ns).exists():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    record.unlink(missing_ok=True)


def clean() -> list[str]:
    """Delete what twins of launchers no longer running left (their records name it); returns the
    namespaces deleted. A running job's twin, and anything no record names, is left as it is."""
    removed = []
    for record in sorted(STATE.glob("*.json")) if STATE.is_dir() else []:
        try:
            made = json.loads(record.read_text())
            owner, start, namespaces = int(made["pid"]), made["start"], list(made["namespaces"])
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not a record of ours, or half written by a launcher still making it
        if _start_time(owner) is not None and _start_time(owner) == start:
            continue  # its launcher still runs
        removed += [ns for ns in namespaces if (NETNS / ns).exists()]
        _remove(record, namespaces)
    return removed


def enter(ns: str) -> None:
    """Move the calling process into namespace ns (before it opens a socket; in a process of one
    thread, e.g. a child between fork and exec or just forked)."""
    fd = os.open(NETNS / ns, os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into the cluster twin's namespace {ns}")
    finally:
        os.close(fd)
