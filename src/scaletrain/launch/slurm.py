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

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from ..config import Config, dump_toml, load_config
from ..plan import format_table, make_plan
from ..strategies import entry
from .env import LaunchError, expand_nodelist, slurm_port


def plan_of(cfg: Config):
    return make_plan(cfg.cluster, entry(cfg).uses_ps, use_gpu=cfg.train.device != "cpu")


def script(cfg: Config, run_dir: Path, partition: str = "", time: str = "", account: str = "",
           resume: bool = False) -> str:
    plan = plan_of(cfg)
    run_dir = run_dir.resolve()
    opts = [f"--job-name=scaletrain-{run_dir.name}", f"--nodes={plan.nodes_total}", f"--ntasks={plan.world_size}",
            f"--output={run_dir}/logs/slurm-%j.out"]
    if cfg.train.device != "cpu":
        opts.append(f"--gpus-per-node={cfg.cluster.gpus_per_node}")
    opts += [f"--{k}={v}" for k, v in (("partition", partition), ("time", time), ("account", account)) if v]
    cmd = [sys.executable, "-m", "scaletrain.launch.slurm", str(run_dir)] + (["--resume"] if resume else [])
    placement = format_table(plan).splitlines()[: plan.nodes_total + 1]
    return "\n".join(["#!/bin/bash", *(f"#SBATCH {o}" for o in opts),
                      "# Written by `scaletrain slurm`; the placement (`scaletrain plan`):",
                      *(f"#   {line}" for line in placement),
                      "# Every process finds its role from SLURM_PROCID, SLURM_NODEID and the plan.",
                      "exec " + shlex.join(cmd), ""])


def write(cfg: Config, run_dir: Path, **opts) -> Path:
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(dump_toml(cfg))
    path = run_dir / "job.sbatch"
    path.write_text(script(cfg, run_dir, **opts))
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
    plan = plan_of(cfg)
    job = os.environ.get("SLURM_JOB_ID", "0")
    hosts = expand_nodelist(os.environ.get("SLURM_JOB_NODELIST", ""))
    if len(hosts) < plan.nodes_total:
        raise LaunchError(f"the plan needs {plan.nodes_total} nodes; this allocation has {len(hosts)} "
                          f"({os.environ.get('SLURM_JOB_NODELIST', '')}): `scaletrain slurm` asks for the right count")
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    if not (run_dir / "config.toml").exists():
        (run_dir / "config.toml").write_text(dump_toml(cfg))
    hostfile = run_dir / "logs" / f"hosts-{job}.txt"
    hostfile.write_text("".join(f"{hosts[p.node]}\n" for p in plan.procs))
    port = cfg.cluster.master_port or slurm_port(job)
    print(f"Slurm job {job}: {plan.world_size} processes on {', '.join(hosts[:plan.nodes_total])}; "
          f"rendezvous {hosts[0]}:{port}", flush=True)
    cmd = ["srun", f"--ntasks={plan.world_size}", f"--nodes={plan.nodes_total}", "--distribution=arbitrary",
           "--kill-on-bad-exit=1", "--overcommit", sys.executable, "-m", "scaletrain.launch.entry", str(run_dir)]
    cmd += (["--resume"] if resume else []) + ([] if progress else ["--quiet"])
    return subprocess.call(cmd, env=dict(os.environ, SLURM_HOSTFILE=str(hostfile)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scaletrain.launch.slurm",
                                 description="start every process of RUN_DIR's job (inside a Slurm allocation)")
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--resume", action="store_true")
    a = ap.parse_args(argv)
    try:
        rc = run_job(load_config(a.run_dir / "config.toml"), a.run_dir, a.resume)
    except LaunchError as e:
        print(f"scaletrain: error: {e}", file=sys.stderr)
        return 2
    if rc == 0:
        from ..cli import summary_line

        print(summary_line(json.loads((a.run_dir / "summary.json").read_text())))
    return rc


if __name__ == "__main__":
    sys.exit(main())
