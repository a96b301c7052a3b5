"""Slurm: an sbatch script from the plan, and the job step that starts every process.

`scaletrain slurm` writes RUN_DIR/config.toml (the resolved config) and
RUN_DIR/job.sbatch, and with --submit hands it to sbatch. The script asks
for the plan's node count and process count and runs
`python -m scaletrain.launch.slurm RUN_DIR`, which (like `scaletrain train`
started inside an allocation) starts one srun step with every process of the
plan. Nodes may run different numbers of processes (a PS alongside), so the
step uses --distribution=arbitrary with a host file that names, for each
global rank in order, the host of its plan node: task i is rank i, on the
node the plan gives it (each process checks SLURM_NODEID against the plan).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

from ..config import Config, dump_toml
from ..plan import format_table
from .env import LaunchError, plan_for, slurm_hosts, slurm_port


def script(cfg: Config, run_dir: Path, train_args: list[str], partition: str = "", time: str = "",
           account: str = "") -> str:
    """The sbatch script: the plan's nodes and tasks, then `scaletrain train` (which, in the
    batch step of an allocation, starts the job step below)."""
    plan = plan_for(cfg)
    run_dir = run_dir.resolve()
    opts = [f"--job-name=scaletrain-{run_dir.name}", f"--nodes={plan.nodes_total}", f"--ntasks={plan.world_size}",
            f"--output={run_dir}/logs/slurm-%j.out"]
    if cfg.train.device != "cpu":
        opts.append(f"--gpus-per-node={cfg.cluster.gpus_per_node}")
    opts += [f"--{k}={v}" for k, v in (("partition", partition), ("time", time), ("account", account)) if v]
    cmd = [sys.executable, "-m", "scaletrain", "train", *train_args, "--run-dir", str(run_dir)]
    placement = format_table(plan).splitlines()[: plan.nodes_total + 1]
    return "\n".join(["#!/bin/bash", *(f"#SBATCH {o}" for o in opts),
                      "# Written by scaletrain; the placement (`scaletrain plan`):",
                      *(f"#   {line}" for line in placement),
                      "# Every process finds its role from SLURM_PROCID, SLURM_NODEID and the plan.",
                      f"mkdir -p {shlex.quote(str(run_dir / 'logs'))}",
                      "exec " + shlex.join(cmd), ""])


def write(cfg: Config, run_dir: Path, resume: bool = False, **opts) -> Path:
    """RUN_DIR/config.toml (the resolved config, which the job reads) and RUN_DIR/job.sbatch."""
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(dump_toml(cfg))
    path = run_dir / "job.sbatch"
    args = ["--recipe", str((run_dir / "config.toml").resolve())] + (["--resume"] if resume else [])
    path.write_text(script(cfg, run_dir, args, **opts))
    return path


def submit(path: Path, wait: bool) -> int:
    """sbatch the script; with wait, block until the job ends and return its exit status."""
    cmd = ["sbatch", "--parsable"] + (["--wait"] if wait else []) + [str(path)]
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    except FileNotFoundError:
        raise LaunchError("sbatch not found: run on a Slurm login node (or drop --submit)") from None
    job = proc.stdout.readline().strip().split(";")[0]
    if job:
        print(f"submitted batch job {job}; output in {path.parent / 'logs'}/slurm-{job}.out", flush=True)
    rc = proc.wait()
    if rc and wait:
        print(f"scaletrain: error: Slurm job {job or '?'} failed (exit status {rc}); "
              f"see {path.parent / 'logs'}", file=sys.stderr)
    return rc


def run_job(cfg: Config, run_dir: Path, resume: bool = False, progress: bool = True) -> int:
    """Inside an allocation: start every process of the plan with one srun step."""
    plan = plan_for(cfg)
    job = os.environ.get("SLURM_JOB_ID", "0")
    hosts = slurm_hosts(plan, os.environ)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(dump_toml(cfg))  # what every process of the step reads
    hostfile = run_dir / "logs" / f"hosts-{job}.txt"
    hostfile.write_text("".join(f"{hosts[p.node]}\n" for p in plan.procs))
    port = cfg.cluster.master_port or slurm_port(job)
    print(f"Slurm job {job}: {plan.world_size} processes on {', '.join(hosts[:plan.nodes_total])}; "
          f"rendezvous {hosts[0]}:{port}", flush=True)
    cmd = ["srun", f"--ntasks={plan.world_size}", f"--nodes={plan.nodes_total}", "--distribution=arbitrary",
           "--kill-on-bad-exit=1", "--overcommit", sys.executable, "-m", "scaletrain.launch.entry", str(run_dir)]
    cmd += (["--resume"] if resume else []) + ([] if progress else ["--quiet"])
    return subprocess.call(cmd, env=dict(os.environ, SLURM_HOSTFILE=str(hostfile)))
