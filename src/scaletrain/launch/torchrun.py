"""torchrun: one command per node, from the plan.

Every agent gets the plan's process count for its node (they may differ:
a PS alongside adds one) and `--plan-node K`, from which its processes take their
ranks in the plan: under the c10d rendezvous torchrun numbers agents in the order they
join, so its GROUP_RANK cannot say which node of the plan an agent is.
The rendezvous id is new for each set of commands, so two jobs never meet.
"""

from __future__ import annotations

import secrets
import shlex
from pathlib import Path

from ..config import Config
from ..plan import Plan, node_line

DEFAULT_PORT = 29400  # torchrun's c10d rendezvous default


def commands(cfg: Config, plan: Plan, recipe: str, overrides: list[str], run_dir: Path) -> list[str]:
    host = cfg.cluster.master_addr
    port = cfg.cluster.master_port or DEFAULT_PORT
    rdzv_id = f"scaletrain-{run_dir.name}-{secrets.token_hex(3)}"
    out = []
    for node in range(plan.nodes_total):
        cmd = ["torchrun", f"--nnodes={plan.nodes_total}", f"--nproc-per-node={len(plan.on_node(node))}",
               "--rdzv-backend=c10d", f"--rdzv-endpoint={host}:{port}", f"--rdzv-id={rdzv_id}", "--max-restarts=0",
               "-m", "scaletrain", "train", "--recipe", str(Path(recipe).resolve()),
               *(a for o in overrides for a in ("--set", o)), "--run-dir", str(run_dir.resolve()), "--plan-node", str(node)]
        out += [f"# {node_line(plan, node)}", shlex.join(cmd)]
    return out
