"""The cluster twin: emulated nodes with a network of their own (netns.py), its link self-test
(selftest.py) and the figures of a time-dilated job (dilation.py). The local launcher only."""

from __future__ import annotations

import json
from pathlib import Path

from .netns import IFNAME, Twin, address, clean, privileges
from .selftest import check, measure

PORT = 29500  # the rendezvous in node 1's namespace, where no other socket listens


def for_job(cluster, nodes: int, run_dir: Path, say=lambda what: None) -> Twin:
    """The twin of a job of `nodes` nodes (cluster: its ClusterConfig), its links self-tested, described
    in RUN_DIR/logs/twin.json; closed again if anything fails."""
    k = cluster.time_scale
    cluster_rates = [cluster.slow_link_gbps if n == cluster.slow_link_node else cluster.link_gbps for n in range(nodes)]
    twin = Twin.make(nodes, [g / k for g in cluster_rates])
    try:
        say(f"cluster twin: {nodes} nodes, a network namespace each, links at {', '.join(f'{g:g}' for g in sorted(set(twin.gbps)))} Gbit/s"
            + (f" (the cluster's / {k:g})" if k != 1 else ""))
        test = check(twin)
        if test:
            lo, hi = min(test["measured_gbps"]), max(test["measured_gbps"])
            say(f"cluster twin: links deliver {lo:.3g}" + (f"-{hi:.3g}" if f"{hi:.3g}" != f"{lo:.3g}" else "") +
                f" Gbit/s while all send at once ({test['ratio']:.0%} of the set rate at worst)")
        (run_dir / "logs" / "twin.json").write_text(json.dumps({
            "namespaces": twin.namespaces, "addresses": [address(n) for n in range(nodes)], "ifname": IFNAME,
            "cluster_link_gbps": cluster_rates, "twin_link_gbps": list(twin.gbps), "self_test": test}, indent=1) + "\n")
    except BaseException:
        twin.close()
        raise
    return twin
