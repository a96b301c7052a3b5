"""Network faults in a running job's twin, acted on from outside the job: node k's link down (a
partition: it reaches no other node) or up again, or slowed (a straggling link).

The job's launcher made the twin and described it in RUN_DIR/logs/twin.json: the namespaces (the
hub's name ends in 'h'; node k's veth end in the hub is `n<k>`). A link set down is the hub's end of
the veth pair, so node k's own interface, its addresses and its processes stay as they were, as a
cable pulled at a switch. A rate is given at the cluster's speed, as cluster.link_gbps is: the twin
runs cluster.time_scale times slower (config.toml of the run), so its links get the rate / time_scale,
set on both ends as the launcher set them (netns.Twin.shape). Nothing here makes or removes a
namespace: the twin stays the launcher's, which removes it when the job ends.

Nodes are numbered here as the job's messages number them: node 1 is the chief's (plan.node_name),
where cluster.slow_link_node counts from 0.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass
from pathlib import Path

from ..errors import LaunchError
from .netns import NETNS, Twin


@dataclass(frozen=True)
class Running:
    """A running job's twin as its twin.json and config.toml describe it."""

    twin: Twin
    time_scale: float

    def node(self, number: int) -> int:
        """The 0-based node of a node number as messages print it (1-based); one line if out of range."""
        if not 1 <= number <= self.twin.nodes:
            raise LaunchError(f"--node {number}: the job's nodes are 1..{self.twin.nodes} (node 1 is the chief's)")
        return number - 1


def running(run_dir: Path) -> Running:
    """The twin of the job running in run_dir; LaunchError (one line) when it has none or it ended."""
    described = Path(run_dir) / "logs" / "twin.json"
    try:
        made = json.loads(described.read_text())
        namespaces, gbps = list(made["namespaces"]), [float(g) for g in made["twin_link_gbps"]]
    except FileNotFoundError:
        raise LaunchError(f"{run_dir}: no cluster twin ({described} is missing: the job did not run with "
                          "cluster.network = netns, or has not made its twin yet)") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise LaunchError(f"{described}: not a cluster twin's description ({e})") from None
    hub = namespaces[0] if namespaces else ""
    if not (hub.startswith("st") and hub.endswith("h")) or len(namespaces) != len(gbps) + 1:
        raise LaunchError(f"{described}: not a cluster twin's description (namespaces {namespaces})")
    if not all((NETNS / ns).exists() for ns in namespaces):
        raise LaunchError(f"{run_dir}: its job is not running (the namespaces of its twin, {hub} and its nodes', "
                          "are gone)")
    twin = Twin(hub[2:-1], len(gbps), gbps, namespaces)
    return Running(twin, _time_scale(Path(run_dir)))


def _time_scale(run_dir: Path) -> float:
    """cluster.time_scale of the run (config.toml, written by the launcher before its processes start)."""
    try:
        return float(tomllib.loads((run_dir / "config.toml").read_text())["cluster"].get("time_scale", 1.0))
    except (OSError, ValueError, KeyError, TypeError, tomllib.TOMLDecodeError) as e:
        raise LaunchError(f"{run_dir / 'config.toml'}: cannot read cluster.time_scale ({e})") from None


def link(run_dir: Path, number: int, up: bool) -> str:
    """Set node `number`'s link down (a partition) or up; what was done, in one line."""
    job = running(run_dir)
    job.twin.link(job.node(number), up)
    return f"node {number}'s link is {'up' if up else 'down: it reaches no other node'}"


def slow(run_dir: Path, number: int, gbps: float) -> str:
    """Set node `number`'s link, both ways, to gbps at the cluster's speed; what was done, in one line."""
    if not 0.001 <= gbps <= 400:
        raise LaunchError(f"--gbps {gbps:g}: a link's rate is 0.001..400 Gbit/s")
    job = running(run_dir)
    twin_gbps = gbps / job.time_scale
    job.twin.shape(job.node(number), twin_gbps)
    scaled = f" ({twin_gbps:.4g} Gbit/s in the twin: cluster.time_scale = {job.time_scale:g})" \
        if job.time_scale != 1 else ""
    return f"node {number}'s link runs at {gbps:g} Gbit/s each way{scaled}"
