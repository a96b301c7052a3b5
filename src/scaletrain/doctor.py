"""`scaletrain doctor`: what to check on a machine before a long job, in one command.

The torch build and what CUDA it sees, the GPUs, the interfaces gloo and NCCL would use, the
Slurm allocation, cores and memory; with a recipe, each setting that would not take effect or
would fail here, as one line each. `gather` reads the real facts; everything else is a pure
function of them (environment, torch facts, interfaces, host), so made-up GPU clusters test it.

Where doctor runs decides what a recipe is checked against (`machine`): where the local launcher
would run every process of the job (the whole plan, its emulated nodes on this host), a node of a
Slurm allocation or a torchrun agent (this node's share), or a login node of a Slurm cluster (sinfo
or squeue here, no allocation): there the job's processes run on other machines, so a recipe is
checked for what one node of the job needs (cluster.gpus_per_node GPUs, not the job's total) and
`scaletrain slurm` checks the rest against the cluster's nodes.

Exit status 1 when a warning says the job would fail as configured: a device its processes would
refuse (device.resolve: train.device = cuda with no GPU, a CPU torch in a GPU allocation),
cluster.gpus_per_node above the GPUs visible (plan.gpu_map), a plan that
cannot be placed or needs more nodes or CPUs than the allocation has (srun refuses the step),
cluster.ifname not on this host, data.root / data.test_root / model.init_from not found, a
model.name by import path that does not import or build here (models/factory.py).
The others (bf16 or channels_last on a CPU: device.not_applied) leave a job that runs, only not
as meant.
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import socket
import sys
import warnings as pywarnings
from pathlib import Path

from .config import ROOTS, Config, ConfigError, load_config
from .device import Facts, not_applied, resolve, slurm_gpus
from .errors import LaunchError, ModelNameError, PlanError
from .models import check_network
from .plan import node_name
from .proc import fabric
from .proc.cpus import node_needs
from .proc.env import expand_nodelist, in_slurm_allocation, in_torchrun, plan_for

SLURM = {"job_id": "SLURM_JOB_ID", "partition": "SLURM_JOB_PARTITION", "tasks": "SLURM_NTASKS",
         "cpus_on_node": "SLURM_CPUS_ON_NODE", "cpus_per_task": "SLURM_CPUS_PER_TASK",
         "gpus_on_node": "SLURM_GPUS_ON_NODE", "job_gpus": "SLURM_JOB_GPUS", "step_gpus": "SLURM_STEP_GPUS"}


COMMANDS = ("sbatch", "srun", "sinfo", "squeue")
MACHINES = {
    "local": "every process of the job runs here (the local launcher)",
    "allocation": "a node of a Slurm allocation: this node's share of the job",
    "torchrun": "a torchrun agent's node: this node's share of the job",
    "login": ("a login node of a Slurm cluster (Slurm's commands here, no allocation): a recipe is checked for one "
              "node of the job; `scaletrain slurm` checks its script against the cluster's nodes, and `srun "
              "scaletrain doctor` inside the allocation checks each node"),
}


def commands(env=os.environ) -> dict[str, str | None]:
    """Where Slurm's commands are on env's PATH (None: not found)."""
    return {c: shutil.which(c, path=env.get("PATH")) for c in COMMANDS}


def machine(env, found: dict) -> str:
    """What this machine is to a job (a key of MACHINES), from the environment and the commands found:
    a Slurm allocation's node or a torchrun agent's by their variables; a login node where Slurm's
    query commands are but no allocation (a job's processes then run on the cluster's nodes, never
    here); else the machine the local launcher runs every process on."""
    if in_slurm_allocation(env):
        return "allocation"
    if in_torchrun(env):
        return "torchrun"
    return "login" if found.get("sinfo") or found.get("squeue") else "local"


def torch_facts() -> dict:
    """The torch build and the GPUs it sees. Every CUDA call is guarded: a CPU build, a missing
    driver or a GPU in a bad state becomes `error`, never an exception."""
    import torch  # heavy: the CLI imports this module for every command; only `doctor` reads torch's facts

    f = {"version": torch.__version__, "cuda": torch.version.cuda, "hip": getattr(torch.version, "hip", None),
         "nccl": None, "cudnn": None, "gpus": [], "error": None}
    if f["cuda"] is None and f["hip"] is None:
        return f
    try:
        with pywarnings.catch_warnings(record=True) as said:  # torch warns, not raises, when it finds no driver
            pywarnings.simplefilter("always")
            if torch.cuda.is_available():
                for i in range(torch.cuda.device_count()):
                    p = torch.cuda.get_device_properties(i)
                    f["gpus"].append({"index": i, "name": p.name, "memory_bytes": p.total_memory})
            f["error"] = next((str(w.message).splitlines()[0] for w in said if "CUDA" in str(w.message)), None)
        if torch.distributed.is_available() and torch.distributed.is_nccl_available():
            f["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        if torch.backends.cudnn.is_available():
            f["cudnn"] = torch.backends.cudnn.version()
    except (RuntimeError, AssertionError, OSError) as e:
        f["error"] = str(e).splitlines()[0] if str(e) else type(e).__name__
    return f


def gather(env=os.environ) -> tuple[dict, dict, dict, dict]:
    """This machine's facts: (torch facts, environment, interfaces, host)."""
    ifaces = fabric.interfaces()
    try:  # "MemTotal:  24683656 kB"
        mem = {k: int(v.split()[0]) * 1024 for k, _, v in map(lambda line: line.partition(":"),
                                                               Path("/proc/meminfo").read_text().splitlines())}
    except (OSError, ValueError, IndexError):
        mem = {}
    host = {"name": socket.gethostname(), "hostname_ifname": fabric.hostname_interface(ifaces),
            "cpu_count": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)),
            "memory_bytes": mem.get("MemTotal"), "memory_available_bytes": mem.get("MemAvailable"),
            **commands(env)}
    return torch_facts(), dict(env), ifaces, host


def slurm_facts(env: dict, host: dict) -> dict:
    """The allocation as Slurm's variables give it (every key present; None outside one)."""
    inside = in_slurm_allocation(env)
    out = {"allocation": inside, **{k: env.get(v) if inside else None for k, v in SLURM.items()},
           "nodes": None, "node": None, "gpus": None, "sbatch": host["sbatch"], "srun": host["srun"]}
    if not inside:
        return out
    try:
        out["nodes"] = expand_nodelist(env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", ""))
    except LaunchError:
        out["nodes"] = []
    out["node"] = env.get("SLURMD_NODENAME") or host["name"].split(".")[0]  # an salloc shell has no SLURMD_*
    out["gpus"] = slurm_gpus(env)
    return out


def network(cfg: Config, env: dict, ifaces: dict, host: dict, slurm: dict,
            where: str = "local") -> tuple[dict, str | None]:
    """The interfaces of gloo's and NCCL's sockets as comm.groups.init would set them; and the error
    it would raise for a cluster.ifname this host lacks."""
    c, error = cfg.cluster, None
    try:
        local = c.master_addr == "localhost" or ipaddress.ip_address(c.master_addr).is_loopback
    except ValueError:  # a host name: the job's processes are spread over machines
        local = False
    try:
        chosen = fabric.choose(c.ifname, ifaces, where == "local" and local)
    except LaunchError as e:
        chosen, error = None, str(e)
    why = ("cluster.ifname" if c.ifname else "loopback: every process on this machine" if chosen == "lo"
           else "an InfiniBand interface first, as NCCL chooses")
    out = {"interfaces": ifaces}
    for lib, key, default in (("gloo", "GLOO_SOCKET_IFNAME", (host["hostname_ifname"], "the host name's interface")),
                              ("nccl", "NCCL_SOCKET_IFNAME", (None, "NCCL's own choice"))):
        name, reason = (env[key], f"set by {key}") if env.get(key) else (chosen, why) if chosen else default
        out[lib] = {"ifname": name, "address": ifaces.get(name), "why": reason}
    return out, error


def checks(cfg: Config | None, tf: dict, slurm: dict, net_error: str | None,
           exists=os.path.exists, env=os.environ, where: str = "local") -> list[dict]:
    """Each mismatch between the config and this machine: {"text": one line, "fails": would the job fail}.
    where: machine()'s word for this machine; on a login node, what one node of the job needs."""
    out = []

    def warn(text: str, fails: bool = False) -> None:
        out.append({"text": text, "fails": fails})

    here = Facts(len(tf["gpus"]), tf["cuda"], tf["version"], slurm["gpus"] or 0)
    want = cfg.train.device if cfg else "auto"
    if where == "login":
        kind = _login_device(cfg, here, warn)
    else:
        try:
            kind = resolve(want, here)  # the one decision a job's processes make (device.py)
        except PlanError as e:
            warn(str(e), fails=True)
            kind = "cpu"
    if cfg is None:
        return out
    for key, why in not_applied(cfg, kind).items():
        if not (where == "login" and key == "cluster.setup"):  # the sbatch script written here runs it
            warn(f"{key} = {why}: not applied")
    if net_error:  # a login node's interfaces are not the job's nodes'
        warn(net_error + ("; on this login node: `srun scaletrain doctor` checks the job's nodes" if where == "login"
                          else ""), fails=where != "login")
    for key, path in (("data.root", cfg.data.root if cfg.data.name in ROOTS else ""),
                      ("data.test_root", cfg.data.test_root if cfg.data.name in ROOTS else ""),
                      ("model.init_from", cfg.model.init_from)):
        if path and not exists(path):
            warn(f"{key} = {path!r}: not found from {os.getcwd()}", fails=True)
    try:
        check_network(cfg)  # a network by import path: imported here, built, a dummy batch through it
    except ModelNameError as e:
        warn(str(e), fails=True)
    try:
        # This host's GPUs, as a worker checks; a login node runs no process of the job: the plan's own layout
        plan = plan_for(cfg, here, env) if kind == "cuda" and where != "login" else plan_for(cfg)
    except PlanError as e:
        warn(str(e), fails=True)
        return out
    if slurm["allocation"] and slurm["nodes"]:
        if len(slurm["nodes"]) < plan.nodes_total:
            warn(f"the plan needs {plan.nodes_total} nodes; this allocation has {len(slurm['nodes'])} "
                 f"({' '.join(slurm['nodes'])})", fails=True)
        at = slurm["nodes"].index(slurm["node"]) if slurm["node"] in slurm["nodes"] else -1
        have = int(slurm["cpus_on_node"]) if (slurm["cpus_on_node"] or "").isdigit() else None
        if 0 <= at < plan.nodes_total and have is not None:
            need = node_needs(plan, cfg)[at]  # what the job's processes take of this node (proc/cpus.py)
            if need.cpus > have:
                warn(f"{node_name(at)} of the plan ({slurm['node']}) needs {need.cpus} CPUs ({need.words()}) but "
                     f"Slurm gave this job {have} here: lower data.workers or ask for more CPUs", fails=True)
    return out


def _login_device(cfg: Config | None, here: Facts, warn) -> str:
    """The device type the job's processes take on the cluster's nodes, as far as a login node can
    tell: its GPUs are not theirs (often it has none), its torch is theirs unless cluster.setup
    makes their environment."""
    if cfg is None or cfg.train.device == "cpu":
        return "cpu"
    if here.cuda_build is None:
        if cfg.cluster.setup:  # the sbatch script's environment may bring a CUDA build: not this one's to judge
            return "cuda"
        # 'auto' on nodes without GPUs computes on their CPUs; on nodes with GPUs it refuses them (device.resolve)
        warn(f"torch {here.torch_version} here is a CPU build: the job's processes would refuse the nodes' GPUs "
             f"(train.device = {cfg.train.device!r}{'' if cfg.train.device == 'cuda' else ', where they have any'}); "
             "install a CUDA build of torch in the job's environment (cluster.setup can make it), or set "
             "train.device = 'cpu'", fails=cfg.train.device == "cuda")
        return "cpu"
    return "cuda"


def report(tf: dict, env: dict, ifaces: dict, host: dict, cfg: Config | None = None, exists=os.path.exists) -> dict:
    """The whole picture as one JSON-ready object (stable keys)."""
    slurm = slurm_facts(env, host)
    where = machine(env, host)
    net, net_error = network(cfg or Config(), env, ifaces, host, slurm, where)
    build = ("CPU" if tf["cuda"] is None and tf["hip"] is None else f"CUDA {tf['cuda']}" if tf["cuda"]
             else f"ROCm {tf['hip']}")
    gpus = tf["gpus"]
    seen = f"{len(gpus)} GPU{'s' if len(gpus) > 1 else ''} visible ({gpus[0]['name']})" if gpus else "no GPU visible"
    alloc = f"Slurm job {slurm['job_id']} on {slurm['node']}" if slurm["allocation"] else \
        "not in a Slurm allocation" + (", a login node of a Slurm cluster" if where == "login" else
                                       "" if host["sbatch"] or host["srun"] else " (no sbatch or srun here)")
    return {"summary": f"this machine: {seen}, {build} build of torch, {alloc}",
            "machine": {"kind": where, "why": MACHINES[where]},
            "torch": {"version": tf["version"], "build": build.split()[0].lower(), "cuda": tf["cuda"],
                      "hip": tf["hip"], "nccl": tf["nccl"], "cudnn": tf["cudnn"], "error": tf["error"]},
            "gpus": {"visible": gpus, "CUDA_VISIBLE_DEVICES": env.get("CUDA_VISIBLE_DEVICES")},
            "network": net, "slurm": slurm,
            "host": {k: host[k] for k in ("name", "cpu_count", "affinity", "memory_bytes", "memory_available_bytes")},
            "warnings": checks(cfg, tf, slurm, net_error, exists, env, where)}


def _cudnn(v: int) -> str:
    """torch's cuDNN number as a version: 91002 -> 9.10.2 (cuDNN 9), 8902 -> 8.9.2 (before)."""
    return f"{v // 10000}.{v // 100 % 100}.{v % 100}" if v >= 90000 else f"{v // 1000}.{v // 100 % 10}.{v % 100}"


def human(rep: dict) -> str:
    """Short aligned lines, a section per topic, warnings last."""
    t, g, n, s, h = rep["torch"], rep["gpus"], rep["network"], rep["slurm"], rep["host"]

    def show(v) -> str:
        return "none" if v is None else str(v)

    def sock(lib: str) -> str:
        d = n[lib]
        return f"{d['ifname'] or '-'}{' ' + d['address'] if d['address'] else ''} ({d['why']})"

    gib = lambda b: "?" if b is None else f"{b / 2**30:.1f} GiB"  # noqa: E731
    sections = {
        "torch": [("version", f"{t['version']} ({dict(cpu='CPU', cuda='CUDA', rocm='ROCm')[t['build']]} build)"),
                  ("CUDA runtime", show(t["cuda"] or t["hip"])), ("NCCL", show(t["nccl"])),
                  ("cuDNN", show(t["cudnn"] and _cudnn(t["cudnn"])))] + ([("CUDA error", t["error"])] if t["error"] else []),
        "GPUs": ([(f"GPU {d['index']}", f"{d['name']}, {gib(d['memory_bytes'])}") for d in g["visible"]]
                or [("visible", "none")]) + [("CUDA_VISIBLE_DEVICES", "unset" if g["CUDA_VISIBLE_DEVICES"] is None
                                                       else g["CUDA_VISIBLE_DEVICES"] or "'' (hides every GPU)")],
        "network": [("gloo", sock("gloo")), ("NCCL", sock("nccl")),
                    ("interfaces", ", ".join(f"{k} {v}" for k, v in n["interfaces"].items()) or "none")],
        "Slurm": ([("job", f"{s['job_id']}" + (f" (partition {s['partition']})" if s["partition"] else "")),
                   ("nodes", f"{' '.join(s['nodes'])} ({len(s['nodes'])})"), ("this node", s["node"]),
                   ("tasks", s["tasks"] or "unset"),
                   ("CPUs", f"{s['cpus_on_node'] or 'unset'} on this node, {s['cpus_per_task'] or '1 (the default)'} "
                            "per task"),
                   ("GPUs", f"{s['gpus']} on this node (" + ", ".join(f"{SLURM[k]} {s[k] or 'unset'}" for k in
                                                                   ("gpus_on_node", "job_gpus", "step_gpus")) + ")")]
                  if s["allocation"] else [("allocation", "not in a Slurm allocation")])
                 + [(cmd, s[cmd] or "not found") for cmd in ("sbatch", "srun")],
        "host": [("name", h["name"]), ("CPU cores", f"{h['cpu_count']} ({h['affinity']} usable by this process)"),
                 ("memory", f"{gib(h['memory_bytes'])} ({gib(h['memory_available_bytes'])} available)")],
    }
    lines = [rep["summary"], f"  {rep['machine']['why']}"]
    for title, rows in sections.items():
        lines += ["", title] + [f"  {k:<21} {v}" for k, v in rows]
    if rep["warnings"]:
        lines.append("")
    lines += [f"warning: {w['text']}" + ("; the job would fail" if w["fails"] else "") for w in rep["warnings"]]
    return "\n".join(lines)


def main(args) -> int:
    """`scaletrain doctor`: 0, 1 when a warning says the job would fail, 2 for bad input."""
    cfg = None
    if args.recipe or args.overrides:  # --set alone: the defaults with those keys
        try:
            cfg = load_config(args.recipe, args.overrides)
        except ConfigError as e:
            print(f"scaletrain: config error: {e}", file=sys.stderr)
            return 2
    rep = report(*gather(), cfg=cfg)
    print(json.dumps(rep, indent=2) if args.format == "json" else human(rep))
    return 1 if any(w["fails"] for w in rep["warnings"]) else 0
