"""The local launcher: every process of the plan on this machine.

Emulated nodes are groups of processes; the rendezvous listens on loopback.
Rank 0 (the chief) writes to this terminal, the others to RUN_DIR/logs/.
When a process fails, the others get cluster.timeout_s + 5 s to notice and
exit on their own (their logs then name the lost rank), then are killed; the
launcher exits non-zero naming the first rank that failed. Ctrl-C stops all.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from ..config import Config, dump_toml
from ..plan import Plan
from .env import LaunchError, plan_for


def free_port(addr: str) -> int:
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def check_port(addr: str, port: int) -> None:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((addr, port))
        except OSError as e:
            raise LaunchError(f"cluster.master_port = {port}: cannot listen on {addr}:{port} ({e.strerror}); "
                              "choose another port or 0 for a free one") from None


def describe_exit(plan: Plan, rank: int, rc: int) -> str:
    how = f"was killed by signal {signal.Signals(-rc).name}" if rc < 0 else f"exited with status {rc}"
    return f"{plan.describe(rank)} {how}"


def launch(cfg: Config, run_dir: Path, resume: bool = False, progress: bool = True) -> int:
    plan = plan_for(cfg, probe_gpu=True)
    addr = cfg.cluster.master_addr
    if cfg.cluster.master_port:
        check_port(addr, cfg.cluster.master_port)
    cfg = cfg.replace(**{"cluster.master_port": cfg.cluster.master_port or free_port(addr)})
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "logs").mkdir(exist_ok=True)
    (run_dir / "config.toml").write_text(dump_toml(cfg))
    threads = max(1, (os.cpu_count() or 1) // plan.world_size)
    job = f"local-{os.getpid()}-{time.time_ns()}"  # names the rendezvous: no other job shares it
    procs: list[subprocess.Popen] = []
    for p in plan.procs:
        env = dict(os.environ, RANK=str(p.rank), WORLD_SIZE=str(plan.world_size), LOCAL_RANK=str(p.local_rank),
                   MASTER_ADDR=addr, MASTER_PORT=str(cfg.cluster.master_port), SCALETRAIN_JOB=job,
                   SCALETRAIN_THREADS=str(threads),
                   OMP_NUM_THREADS=str(threads))
        cmd = [sys.executable, "-m", "scaletrain.launch.entry", str(run_dir)]
        cmd += ["--resume"] if resume else []
        cmd += [] if progress else ["--quiet"]
        out = None if p.rank == 0 else open(run_dir / "logs" / f"rank{p.rank}.log", "w")
        procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT if out else None))
        if out:
            out.close()
    return _watch(plan, procs, cfg.cluster.timeout_s + 5, run_dir)


def _watch(plan: Plan, procs: list[subprocess.Popen], grace: float, run_dir: Path) -> int:
    failed, failed_at = None, 0.0
    try:
        while any(p.poll() is None for p in procs):
            for rank, p in enumerate(procs):
                rc = p.poll()
                if rc not in (None, 0) and failed is None:
                    failed, failed_at = rank, time.time()
                    print(f"scaletrain: {describe_exit(plan, rank, rc)}; waiting up to {grace:.0f} s for the "
                          "others to stop", file=sys.stderr, flush=True)
            if failed is not None and time.time() - failed_at > grace:
                _stop(procs, signal.SIGKILL)
            time.sleep(0.2)
    except KeyboardInterrupt:
        _stop(procs, signal.SIGTERM)
        deadline = time.time() + 5
        while any(p.poll() is None for p in procs) and time.time() < deadline:
            time.sleep(0.1)
        _stop(procs, signal.SIGKILL)
        print("scaletrain: interrupted; every process stopped", file=sys.stderr)
        return 130
    if failed is None:
        failed = next((r for r, p in enumerate(procs) if p.returncode != 0), None)
    if failed is not None:
        print(f"scaletrain: error: job failed: {describe_exit(plan, failed, procs[failed].returncode)}; "
              f"logs in {run_dir / 'logs'}", file=sys.stderr)
        return 1
    return 0


def _stop(procs: list[subprocess.Popen], sig: int) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(sig)
