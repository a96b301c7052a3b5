"""Where this process sits in a job, read from the launcher's environment.

Every launcher gives each process its place differently; all of them end in
the same Rendezvous (global rank in the plan, world size, the address and port
where the processes meet, and a job id that names the rendezvous so one job
never joins another's):

- the local launcher: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, SCALETRAIN_JOB.
- torchrun: LOCAL_RANK, LOCAL_WORLD_SIZE, WORLD_SIZE, MASTER_ADDR,
  MASTER_PORT (torchrun's own store), TORCHELASTIC_RUN_ID; the node comes from
  `--plan-node K` on the command line, because under the c10d rendezvous torchrun's
  GROUP_RANK and RANK are assigned by the rendezvous, not by the plan.
- Slurm (srun): SLURM_PROCID (the global rank: tasks are placed in plan order),
  SLURM_NTASKS, SLURM_NODEID (checked against the plan), SLURM_LOCALID,
  SLURM_JOB_NODELIST (the rendezvous is on its first node), SLURM_JOB_ID (the
  job id, and the default port), SCALETRAIN_PORT (the port, where
  `scaletrain train` started the step and checked it).
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from ..device import Facts, gpus_for_plan
from ..errors import LaunchError
from ..plan import PlanError, Plan, make_plan, node_name
from ..strategies.traits import entry


RUN_DIR_ENV, RESUME_ENV = "SCALETRAIN_RUN_DIR", "SCALETRAIN_RESUME"  # script_env
PLAN_NODE_ENV = "SCALETRAIN_PLAN_NODE"  # a user's script under torchrun: its agent's node in the plan
# A replacement of a dropped rank, started by the local launcher or a rank's keeper (launch/keep.py):
# when it was started (time.time())
LATE = "SCALETRAIN_REPLACES"
# The ranks of a Slurm step of replacements (launch/keep.start_orphans), by task: comma-separated
RANKS = "SCALETRAIN_RANKS"


@dataclass(frozen=True)
class Rendezvous:
    """This process's rank and where the job's processes meet, as its launcher gave them."""

    rank: int      # global rank in the plan
    world: int     # processes in the job
    addr: str      # host of the rendezvous store (rank 0's, or torchrun's agent's)
    port: int
    job: str       # the job's id: the store's keys live under it
    launcher: str  # "local" | "torchrun" | "slurm"
    late: bool = False  # a replacement of a dropped rank, joining the running job (cluster.replacements)


def plan_for(cfg, here: Facts | None = None, env=os.environ) -> Plan:
    """The job's plan. Without `here`, workers are placed on gpus_per_node GPUs of each host
    unless train.device = "cpu" (the layout `scaletrain plan` and the sbatch script show). With
    the facts of this host (device.facts(): a worker about to run, the local launcher before it
    starts them, `scaletrain doctor`), on the GPUs it has, every node of the plan on this host
    unless torchrun started this process or it runs in a Slurm allocation (a node each). Raises PlanError when the host cannot give
    what the config asks (device.resolve, plan.gpu_map)."""
    c = cfg.cluster
    if 0 < c.min_nodes < c.nodes and not entry(cfg).resizable:
        raise PlanError(f"cluster.min_nodes = {c.min_nodes} below cluster.nodes = {c.nodes}: a restart on fewer "
                        f"nodes is not defined for strategy.name = {cfg.strategy.name!r} (its parameter servers' "
                        "updates are tied to the node count); use 'allreduce' or leave min_nodes at 0")
    if here is not None:
        gpus, one_host = gpus_for_plan(cfg.train.device, here), not (in_torchrun(env) or in_slurm_allocation(env))
    else:
        gpus, one_host = (0 if cfg.train.device == "cpu" else c.gpus_per_node), False
    return make_plan(c, entry(cfg).uses_ps, gpus, one_host, cfg.parallel.stages)


def script_env(run_dir: Path, resume: bool) -> dict[str, str]:
    """What a user's script started as a job's process by the local launcher or a Slurm step reads
    (job.Job.from_env): the run's directory and whether it resumes."""
    return {RUN_DIR_ENV: str(run_dir.resolve()), RESUME_ENV: str(int(resume))}


def in_torchrun(env=os.environ) -> bool:
    return "TORCHELASTIC_RUN_ID" in env


def in_slurm_step(env=os.environ) -> bool:
    """A task of an srun step (not the batch script, not an salloc shell)."""
    return "SLURM_STEP_ID" in env and "SLURM_PROCID" in env and env.get("SLURM_STEP_ID") not in ("batch", "extern")


def in_slurm_allocation(env=os.environ) -> bool:
    return "SLURM_JOB_ID" in env


def expand_nodelist(text: str) -> list[str]:
    """Slurm's compact host list, expanded in order: 'gpu[1-3,7],login' -> gpu1 gpu2 gpu3 gpu7 login.
    Zero padding is kept ('n[08-10]' -> n08 n09 n10); several brackets multiply ('r[1-2]n[1-2]')."""
    hosts = []
    for item in re.findall(r"(?:[^,\[]|\[[^\]]*\])+", text):
        m = re.match(r"([^\[]*)\[([^\]]*)\](.*)$", item)
        if not m:
            hosts.append(item)
            continue
        head, ranges, tail = m.groups()
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            if not lo.isdigit() or (hi and not hi.isdigit()):
                raise LaunchError(f"cannot read the Slurm node list {text!r} at {part!r}")
            for i in range(int(lo), int(hi or lo) + 1):
                hosts += [f"{head}{i:0{len(lo)}d}{rest}" for rest in expand_nodelist(tail) or [""]]
    return hosts


def het_groups(env) -> list[str]:
    """The suffixes of a heterogeneous job's components ('_HET_GROUP_0', ...), [''] for a plain job.
    Slurm's SLURM_JOB_NODELIST of a heterogeneous job is the batch host's component alone (in the
    batch step) or every host sorted by name (in a step), not the components in order."""
    size = env.get("SLURM_HET_SIZE", "")
    return [f"_HET_GROUP_{k}" for k in range(int(size))] if size.isdigit() else [""]


def allocation_hosts(env) -> list[str]:
    """The allocation's hosts in order: component by component in a heterogeneous job."""
    return [h for g in het_groups(env) for h in expand_nodelist(env.get(f"SLURM_JOB_NODELIST{g}", ""))]


def slurm_hosts(plan: Plan, env, exclude=()) -> list[str]:
    """The allocation's hosts in order, less `exclude`: plan node k runs on the k-th."""
    hosts = [h for h in allocation_hosts(env) if h not in exclude]
    if len(hosts) < plan.nodes_total:
        raise LaunchError(f"the plan needs {plan.nodes_total} nodes; the allocation has {len(hosts)} "
                          f"({env.get('SLURM_JOB_NODELIST', '')}): `scaletrain slurm` asks for the right count")
    return hosts


def slurm_port(job_id: str) -> int:
    """A rendezvous port from the job id: jobs sharing a first node get different ports.
    Kept under Linux's ephemeral range (32768-60999)."""
    return 15000 + int(re.sub(r"\D", "", job_id) or 0) % 15000


def _int(env, key: str) -> int:
    try:
        return int(env[key])
    except (KeyError, ValueError):
        raise LaunchError(f"environment variable {key} is {'missing' if key not in env else repr(env[key])}; "
                          "start distributed jobs with `scaletrain train`, torchrun or srun") from None


def rendezvous(plan: Plan, master_addr: str, master_port: int, node: int | None = None,
               env=os.environ) -> Rendezvous:
    """This process's rank in `plan` and the job's rendezvous, from whichever launcher started it."""
    if in_torchrun(env):
        return _torchrun_rendezvous(plan, node, env)
    if in_slurm_step(env):
        return _slurm_rendezvous(plan, master_port, env)
    rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
    _check_world(plan, world, "WORLD_SIZE")
    return Rendezvous(rank, world, env.get("MASTER_ADDR", master_addr), _int(env, "MASTER_PORT"),
                      env.get("SCALETRAIN_JOB", "local"), "local", bool(env.get(LATE)))


def _check_world(plan: Plan, world: int, what: str) -> None:
    if world != plan.world_size:
        raise LaunchError(f"{what} = {world} but the plan has {plan.world_size} processes; "
                          "`scaletrain plan` shows how many each node runs")


def _torchrun_rendezvous(plan: Plan, node: int | None, env) -> Rendezvous:
    if node is None:
        if plan.nodes_total > 1:
            raise LaunchError("started by torchrun without --plan-node K: give each node's agent its node index "
                              "(`scaletrain plan --format torchrun` prints the commands)")
        node = 0
    if not 0 <= node < plan.nodes_total:
        raise LaunchError(f"--plan-node {node}: the plan has nodes 0..{plan.nodes_total - 1}")
    here = plan.on_node(node)
    local, local_world = _int(env, "LOCAL_RANK"), _int(env, "LOCAL_WORLD_SIZE")
    if local_world != len(here):
        raise LaunchError(f"{node_name(node)} (--plan-node {node}) runs {len(here)} processes in the plan but torchrun "
                          f"started {local_world}: use --nproc-per-node={len(here)} there")
    _check_world(plan, _int(env, "WORLD_SIZE"), "torchrun's WORLD_SIZE")
    return Rendezvous(here[local].rank, plan.world_size, env["MASTER_ADDR"], _int(env, "MASTER_PORT"),
                      env["TORCHELASTIC_RUN_ID"], "torchrun", bool(env.get(LATE)))


def _slurm_rendezvous(plan: Plan, master_port: int, env) -> Rendezvous:
    rank, world, node = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS"), _int(env, "SLURM_NODEID")
    if env.get(RANKS):  # a step of replacements of one plan node, on its host or a spare (launch/slurm.py)
        rank, world, node = int(env[RANKS].split(",")[rank]), plan.world_size, None
    _check_world(plan, world, "SLURM_NTASKS")
    want = plan.procs[rank].node
    if node is not None and node != want:
        raise LaunchError(f"Slurm placed {plan.describe(rank)} on its node index {node}, the plan on {want}: "
                          "start the job with `scaletrain slurm` (it places tasks in plan order)")
    hosts = slurm_hosts(plan, env)
    job = env.get("SLURM_JOB_ID", "0")
    port = int(env.get("SCALETRAIN_PORT") or master_port or slurm_port(job))  # run_job's, where it started the step
    return Rendezvous(rank, world, hosts[0], port, f"slurm-{job}", "slurm", bool(env.get(LATE)))


def run_dir_for(recipe: str, given: str | None, cfg) -> Path:
    """--run-dir, or runs/RECIPE-TIME. Every process of a torchrun/srun job must be told
    the same one: each would stamp its own time."""
    if given:
        return Path(given)
    if cfg.distributed and (in_torchrun() or in_slurm_step()):
        raise LaunchError("under torchrun or srun every process must be given the same --run-dir")
    return Path(f"runs/{Path(recipe).stem}-{time.strftime('%Y%m%d-%H%M%S')}")
