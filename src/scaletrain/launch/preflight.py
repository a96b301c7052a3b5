"""Checks `scaletrain slurm` makes before it writes or submits a job, so that a job that cannot
run is refused here in one line instead of after its wait in the queue.

- Shape: what the job asks of each node (proc/cpus.py for CPUs; GPUs; --mem) against the
  partition's nodes as `sinfo` lists them, or as --node-cpus, --node-gpus and --node-mem state
  them (away from the cluster, where there is no sinfo). Slurm itself would answer only "Requested
  node configuration is not available", naming no node and no reason. Where the nodes are neither
  stated nor listed, that is said plainly and nothing is checked.
- Paths: data.root, data.test_root and model.init_from are read by every node of the job, from
  wherever the job runs; a relative path would be read from the job's working directory. So they
  are made absolute here (from this directory, as a local run would read them) and must exist.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ..config import ROOTS
from ..errors import LaunchError
from ..plan import Plan, node_name
from ..proc.cpus import NodeNeed, fitting_workers, node_needs

SHARED = "must be on a shared file system the job's nodes see"


@dataclass(frozen=True)
class Part:
    """A component of the allocation: `nodes` nodes, each asked for `cpus` CPUs and `gpus` GPUs."""
    nodes: int
    cpus: int
    gpus: int
    needs: tuple[NodeNeed, ...]  # the plan nodes it holds, in order


def parts(plan: Plan, cfg) -> list[Part]:
    """The allocation's components. One, unless PS have nodes of their own in a GPU job: then a
    second, with no GPU (a heterogeneous job), since --gpus-per-node would reserve GPUs on the PS
    nodes too. The plan puts every worker node before every PS-only node, as components come."""
    needs = node_needs(plan, cfg)
    gpus = cfg.cluster.gpus_per_node if cfg.train.device != "cpu" else 0
    worker_nodes = [n for n in needs if n.workers]
    ps_only = [n for n in needs if not n.workers]
    if not gpus or not ps_only:
        return [Part(len(needs), max(n.cpus for n in needs), gpus, tuple(needs))]
    if needs != worker_nodes + ps_only:
        raise LaunchError("the plan interleaves PS-only and worker nodes; a heterogeneous job cannot hold it")
    return [Part(len(worker_nodes), max(n.cpus for n in worker_nodes), gpus, tuple(worker_nodes)),
            Part(len(ps_only), max(n.cpus for n in ps_only), 0, tuple(ps_only))]


@dataclass(frozen=True)
class Node:
    name: str
    cpus: int | None  # None: not known (a stated shape that leaves it out), not checked
    gpus: int | None
    mem_mb: int | None


STATED = "the nodes stated"


def stated_nodes(plan: Plan, cfg, cpus: int | None = None, gpus: int | None = None, mem: str = "") -> list[Node]:
    """As many nodes as the job needs, of the shape --node-cpus, --node-gpus and --node-mem state
    (None or '': not stated). Their number is the cluster's to give: only the shape is checked."""
    for flag, value in (("--node-cpus", cpus), ("--node-gpus", gpus)):
        if value is not None and value < 0:
            raise LaunchError(f"{flag} {value}: give a count >= 0")
    mb = mem_mb(mem, "--node-mem") if mem else None
    count = sum(p.nodes for p in parts(plan, cfg))
    return [Node(f"stated{i}", cpus, gpus, mb) for i in range(count)]


def stated_words(cpus: int | None, gpus: int | None, mem: str) -> str:
    """'--node-cpus 16 --node-gpus 4' as given, for the script's header and messages."""
    return " ".join(f"{flag} {value}" for flag, value in (("--node-cpus", cpus), ("--node-gpus", gpus),
                                                          ("--node-mem", mem or None)) if value is not None)


def mem_mb(text: str, flag: str = "--mem") -> int:
    """A Slurm memory size ('120G', '512M', '1T', '4000' = MB) in MB; LaunchError when not one."""
    m = re.fullmatch(r"(\d+)([KMGT]?)B?", text.strip().upper())
    if not m:
        raise LaunchError(f"{flag} {text!r}: give a size such as 120G, 64000M or 1T")
    return int(int(m.group(1)) * {"K": 1 / 1024, "": 1, "M": 1, "G": 1024, "T": 1024 ** 2}[m.group(2)])


def gres_gpus(text: str) -> int:
    """GPUs in a sinfo %G field: 'gpu:4', 'gpu:a100:4(S:0-1)', 'gpu:2,shard:8' -> 4, 4, 2."""
    return sum(int(m.group(1)) for m in re.finditer(r"(?:^|,)gpu(?::[^:,(]+)?:(\d+)", text))


def partition_nodes(partition: str, run=subprocess.run) -> tuple[str, list[Node]] | str:
    """(partition name, its nodes) as sinfo lists them; the partition given, else the default one.
    A string says why they are unknown; LaunchError when sinfo answers and lists no node in the
    partition given (sinfo -p of a partition it does not know prints nothing, with exit status 0)."""
    cmd = ["sinfo", "-h", "-N", "-o", "%N|%P|%c|%G|%m"] + (["-p", partition] if partition else [])
    try:
        r = run(cmd, capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        return "sinfo not found"
    except subprocess.TimeoutExpired:
        return "sinfo did not answer in 30 s"
    if r.returncode:
        said = (r.stderr.strip().splitlines() or ["exit status %d" % r.returncode])[-1]
        return f"sinfo: {said.removeprefix('sinfo: ')}"  # its own messages start with its name
    rows = [line.split("|") for line in r.stdout.splitlines() if line.count("|") == 4]
    given = bool(partition)
    if not partition:
        default = {p for _, p, *_ in rows if p.endswith("*")}
        if not default:
            return "no --partition and sinfo shows no default partition"
        rows = [row for row in rows if row[1] in default]
        partition = default.pop().rstrip("*")
    if not rows and given:  # sinfo answered and lists none: sbatch would refuse the script, after it is written
        raise LaunchError(f"--partition {partition}: sinfo lists no node in it (no such partition here, or an "
                          "empty one); `sinfo -s` lists the partitions")
    if not rows:
        return f"sinfo lists no node in partition {partition}"
    try:
        nodes = {n: Node(n, int(c.rstrip("+")), gres_gpus(g), int(m.rstrip("+")) if m.rstrip("+").isdigit() else 0)
                 for n, _, c, g, m in rows}
    except ValueError:
        return f"cannot read sinfo's node list of partition {partition}"
    return partition, list(nodes.values())


def check_fit(plan: Plan, cfg, partition: str, nodes: list[Node], mem: str = "") -> None:
    """LaunchError with one line when the partition (or, with partition = STATED, the node shape
    stated) lacks nodes that can hold the job. What a node's shape leaves out is not checked."""
    want_mem = mem_mb(mem) if mem else 0
    taken: set[str] = set()
    theirs = STATED if partition == STATED else f"partition {partition}'s nodes"
    fix_gpus = "" if partition == STATED else " or choose a GPU partition (--partition)"

    def at_least(have, want):
        return have is None or have >= want

    for part in parts(plan, cfg):
        big = max(part.needs, key=lambda n: n.cpus)
        fits = [n for n in nodes if at_least(n.cpus, part.cpus) and at_least(n.gpus, part.gpus)
                and at_least(n.mem_mb, want_mem) and n.name not in taken]
        if len(fits) >= part.nodes:
            taken.update(n.name for n in fits[:part.nodes])
            continue
        known = [n for n in nodes if n.cpus is not None]
        most_cpus = max((n.cpus for n in known), default=part.cpus)
        if most_cpus < part.cpus:
            raise LaunchError(f"{node_name(big.node)} needs {part.cpus} CPUs ({big.words()}); {theirs} "
                              f"have {_span(n.cpus for n in known)}: {_cpu_advice(cfg, big, most_cpus)}")
        gpus = [n.gpus for n in nodes if n.gpus is not None]
        if gpus and max(gpus) < part.gpus:
            raise LaunchError(f"the job asks {part.gpus} GPUs a node (cluster.gpus_per_node); {theirs} "
                              f"have {_span(gpus)}: lower cluster.gpus_per_node{fix_gpus}")
        mems = [n.mem_mb for n in nodes if n.mem_mb is not None]
        if want_mem and mems and max(mems) < want_mem:
            raise LaunchError(f"--mem {mem} is more than {theirs} have ({_span(mems)} MB): lower --mem, or use "
                              f"--exclusive")
        raise LaunchError(f"the job needs {sum(p.nodes for p in parts(plan, cfg))} nodes of {part.cpus} CPUs"
                          f"{f' and {part.gpus} GPUs' if part.gpus else ''}; partition {partition} has "
                          f"{len(fits) + len(taken)} such nodes of {len(nodes)}: lower cluster.nodes or cluster.num_ps")


def describe(nodes: list[Node]) -> str:
    """'4 nodes of 16 CPUs, 4 GPUs, 1024 MB' (ranges where they differ)."""
    return (f"{len(nodes)} nodes of {_span(n.cpus for n in nodes)} CPUs, {_span(n.gpus for n in nodes)} GPUs, "
            f"{_span(n.mem_mb for n in nodes)} MB")


def _span(values) -> str:
    vs = sorted(set(values))
    return str(vs[0]) if len(vs) == 1 else f"{vs[0]} to {vs[-1]}"


def _cpu_advice(cfg, need: NodeNeed, cpus: int) -> str:
    """What to change so that `need` fits `cpus` CPUs, in the recipe's keys."""
    ways = []
    w = fitting_workers(need, cpus)
    if w >= 0 and w < cfg.data.workers:
        ways.append(f"lower data.workers to {w}")
    if cfg.train.threads > 1:
        ways.append("lower train.threads")
    if need.ps and cfg.cluster.ps_threads > 1:
        ways.append("lower cluster.ps_threads")
    if need.ps and need.workers and need.workers * (need.loaders + need.worker_threads) <= cpus:
        ways.append("use ps_placement = dedicated")
    if not ways:
        ways.append("lower cluster.gpus_per_node")
    return " or ".join(ways)


def absolute_paths(cfg, cwd: Path):
    """cfg with data.root, data.test_root and model.init_from absolute (from cwd); LaunchError
    naming the key when one does not exist."""
    keys = ["model.init_from"] + (["data.root", "data.test_root"] if cfg.data.name in ROOTS else [])
    sets = {}
    for key in keys:
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if not value:
            continue
        path = (cwd / value).resolve()
        if not path.exists():
            raise LaunchError(f"{key} = {value!r}: {path} not found; it {SHARED}, at the same path")
        if str(path) != value:
            sets[key] = str(path)
    return cfg.replace(**sets) if sets else cfg


def check_nodes(plan: Plan, cfg, partition: str, mem: str = "", node_cpus: int | None = None,
                node_gpus: int | None = None, node_mem: str = "", run=subprocess.run) -> tuple[str, bool]:
    """(the script's line on what the job was checked against, whether it was checked at all). The
    node shape when stated (sinfo is then not asked), else the partition's nodes by sinfo; a job that
    does not fit is a LaunchError of one line naming the fix."""
    if node_cpus is not None or node_gpus is not None or node_mem:
        check_fit(plan, cfg, STATED, stated_nodes(plan, cfg, node_cpus, node_gpus, node_mem), mem)
        said = stated_words(node_cpus, node_gpus, node_mem)
        left = [w for w, v in (("CPUs", node_cpus), ("GPUs", node_gpus), ("memory", node_mem or None)) if v is None]
        return (f"Fits the nodes stated ({said}){f'; {_and(left)} not stated, not checked' if left else ''}; "
                "the partition's node count is not checked.", True)
    found = partition_nodes(partition, run)
    if isinstance(found, str):
        return (f"Partition's nodes unknown ({found}): CPUs, GPUs and memory not checked; --node-cpus, --node-gpus "
                "and --node-mem state them.", False)
    name, nodes = found
    check_fit(plan, cfg, name, nodes, mem)
    return f"Fits partition {name}'s nodes (sinfo: {describe(nodes)}).", True


def _and(words: list[str]) -> str:
    return " and ".join(words) if len(words) < 3 else ", ".join(words[:-1]) + " and " + words[-1]
