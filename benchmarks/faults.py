"""Faults injected into real local jobs: how fast each is seen, how the job gets over it, what is lost.

Every scenario starts a job (digits, resnet8, 2 emulated nodes, data.workers=0,
cluster.timeout_s=5, deterministic kernels), injects one fault for real once the
job trains (a signal to the launcher or to one process, kill -9, SIGSTOP), and
follows it to its end, resuming it when it stopped on request. One JSON row per
scenario on stdout:

  fault, strategy
  detect_s        fault -> the job's first word on it (launcher's line, or the stop)
  recover_s       fault -> the job trained again after a restart, or (no restart) -> the last process exited
  exit            exit status of the interrupted job
  steps_lost      steps computed and thrown away (last step reached - step resumed from)
  weights_equal   final weights == an uninterrupted run's (deterministic strategies), null when not compared
  orphans         job processes alive after it ended
  target_reached  (asynchronous jobs that lose a worker node, 3 nodes) the job applied its target's images

Scenarios of asynchronous jobs (3 nodes, 1 PS) lose a worker node and go on:
detect_s is then fault -> the chief's declaration, recover_s fault -> the
first metrics row logged after it.

Rows of the scenarios added since carry `right` (the outcome is the one the
job promises) and, where the job names a process, `named` (the rank its last
word names) beside the rank that should be:
  sigstop-allreduce-3-nodes[-restart]  SIGSTOP of worker 1 (node 2) of 3; with
      min_nodes = 2 and max_restarts = 1 the restart leaves node 2 out
  sigstop-ps-sync                      SIGSTOP of the PS of a sync 2x1 job
  rerun-finished                       a finished run's command again: exit 0,
      summary.json and config.toml byte-equal
  sigterm-start-up                     SIGTERM to the launcher 4 s after launch:
      exit 75, said as a stop (`phase`: the start-up line it came after)
  survive-kill-allreduce, survive-sigstop-allreduce, survive-kill-sync
                                       the lost-node scenario above with
      cluster.survive_loss: the job goes on in place; steps_lost and heal_s
      from summary.json's lost_workers (comm/ring.py)
  survive-overhead                     4 replicas at emulated 0.1 s steps, 60
      steps, cluster.survive_loss off and on alternately, 3 runs each: the
      job's images per second, and the overhead, 1 - on / off (medians)
  goodput-kill-every-30s[-local-sgd, -diloco, -sync]
                                       a worker of 4 killed every 30 s (1000
      steps at emulated 0.1 s): images applied over the job's wall time, with
      replacements that heal from a live replica (sync: going on with fewer
      nodes) and with restarts from the newest checkpoint, each against the
      same job with no failure
  survive-kill-local-sgd, survive-kill-diloco, survive-kill-async-allreduce
                                       the lost-node scenario with survive_loss
  survive-kill-ps-sync, survive-kill-ps-mixed-async
                                       kill -9 of PS shard 1 of 2 with
      survive_loss: shard 0 takes it on; heal_s, updates_lost from lost_workers
  replace-kill-torchrun, survive-kill-torchrun
                                       three torchrun agents, allreduce with
      survive_loss: node 3's worker killed -9; its keeper (launch/keep.py)
      replaces it on its node (or, without replacements, ends 0): every
      agent's status, detect_s, heal_s, and the replacement's start_s, wait_s,
      adopt_s and the survivors' pause_s (summary.json)
  load-allreduce-8x2, -16x2            16 and 32 processes, emulated compute
      0.05 s, the default cluster.timeout_s: start_s (launch -> the chief's
      "data ready, training"), first_row_s (-> first metrics row), total_s

    python benchmarks/faults.py [--only NAME ...] [--save]

--save writes the rows, the command, the commit and the machine's load to
benchmarks/results/faults-<UTC time>-<short commit>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
BASE = ["data.workers=0", "cluster.nodes=2", "cluster.timeout_s=5", "train.steps=60", "train.log_every=5",
        "train.eval_every=0", "train.checkpoint_every=20", "train.deterministic=true"]
STRATEGY = {"allreduce": ["strategy.name=allreduce"], "sync": ["strategy.name=sync", "cluster.num_ps=1"],
            "mixed-async": ["strategy.name=mixed-async", "cluster.num_ps=1"],
            "local-sgd": ["strategy.name=local-sgd", "strategy.sync_every=8"],
            "diloco": ["strategy.name=diloco", "strategy.sync_every=8"]}


def command(run_dir: Path, sets: list[str], resume: bool = False, quiet: bool = True) -> list[str]:
    cmd = [sys.executable, "-m", "scaletrain.cli", "train", "--recipe", "recipes/digits.toml",
           "--run-dir", str(run_dir)] + (["--quiet"] if quiet else []) + (["--resume"] if resume else [])
    for s in BASE + sets:
        cmd += ["--set", s]
    return cmd


class Job:
    """A job in the background, its stderr lines (and with quiet=False its stdout's progress lines,
    in `out`) timestamped as they come."""

    def __init__(self, run_dir: Path, sets: list[str], resume: bool = False, quiet: bool = True) -> None:
        self.run_dir, self.lines, self.out, self.t0 = run_dir, [], [], time.time()
        env = dict(os.environ, OMP_NUM_THREADS="1")
        self.p = subprocess.Popen(command(run_dir, sets, resume, quiet), cwd=ROOT, env=env,
                                  stdout=subprocess.DEVNULL if quiet else subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, start_new_session=True)
        self.reader = threading.Thread(target=self._read, args=(self.p.stderr, self.lines), daemon=True)
        self.reader.start()
        if not quiet:
            threading.Thread(target=self._read, args=(self.p.stdout, self.out), daemon=True).start()

    @staticmethod
    def _read(stream, into: list) -> None:
        for line in stream:
            into.append((time.time(), line.rstrip()))

    def pids(self) -> dict[int, int]:
        logs = self.run_dir / "logs"
        return {int(f.stem[4:]): json.loads(f.read_text())["pid"] for f in logs.glob("rank*.json")} \
            if logs.exists() else {}

    def steps_logged(self) -> list[int]:
        f = self.run_dir / "metrics.jsonl"
        rows = [json.loads(r) for r in f.read_text().splitlines() if r.strip()] if f.exists() else []
        return [r["step"] for r in rows if r.get("kind", "train") == "train" and "step" in r]

    def training(self, world: int, after_step: int = 10) -> dict[int, int]:
        deadline = time.time() + 180
        while time.time() < deadline and self.p.poll() is None:
            steps = self.steps_logged()
            if len(self.pids()) == world and steps and steps[-1] >= after_step:
                return self.pids()
            time.sleep(0.1)
        raise RuntimeError(f"the job did not start: {self.lines[-3:]}")

    def first(self, text: str, since: float) -> float | None:
        return next((t - since for t, line in self.lines if text in line and t >= since), None)

    def until(self, text: str, since: float) -> float | None:
        """Seconds from `since` to the first line with `text`; None when the job ended first."""
        seen = None
        while self.p.poll() is None and seen is None:
            seen = self.first(text, since)
            time.sleep(0.05)
        return seen or self.first(text, since)

    def wait(self) -> int:
        rc = self.p.wait(timeout=600)
        self.reader.join()
        return rc


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def orphans(pids: dict[int, int]) -> int:
    time.sleep(1)
    return sum(alive(p) for p in pids.values())


def same(a: Path, b: Path) -> bool:
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    return wa.keys() == wb.keys() and all(bool((wa[k] == wb[k]).all()) for k in wa)


def newest_checkpoint(run_dir: Path) -> int:
    return max((int(f.stem[5:]) for f in (run_dir / "checkpoints").glob("ckpt-*.pt")), default=0)


def stop_signal(tmp: Path, strategy: str, sig: signal.Signals, to_launcher: bool) -> dict:
    """A stop signal: the job checkpoints at a sync point and exits 75; run again, it resumes."""
    run_dir = tmp / f"stop-{strategy}-{sig.name}"
    job = Job(run_dir, STRATEGY[strategy])
    pids = job.training(3 if strategy != "allreduce" else 2)
    reached = job.steps_logged()[-1]
    t0 = time.time()
    job.p.send_signal(sig) if to_launcher else os.kill(pids[1], sig)
    rc = job.wait()
    exited = time.time() - t0
    stopped_at = newest_checkpoint(run_dir)
    again = Job(run_dir, STRATEGY[strategy], resume=True)
    again.wait()
    return dict(fault=f"{sig.name} to {'the launcher' if to_launcher else 'worker 1'}", strategy=strategy,
                detect_s=job.first("stop", t0), recover_s=exited, exit=rc,
                steps_lost=max(reached - stopped_at, 0) if stopped_at < reached else 0,
                weights_equal=same(run_dir, reference(tmp, strategy)), orphans=orphans(pids))


def kill_with_restart(tmp: Path, strategy: str) -> dict:
    """kill -9 of a worker with cluster.max_restarts=2: the job restarts from its newest checkpoint."""
    run_dir = tmp / f"restart-{strategy}"
    job = Job(run_dir, STRATEGY[strategy] + ["cluster.max_restarts=2"])
    pids = job.training(3 if strategy != "allreduce" else 2, after_step=30)
    reached, t0 = job.steps_logged()[-1], time.time()
    os.kill(pids[1], signal.SIGKILL)
    restart = job.until("restart 1 of", t0)
    resumed_from, rows = newest_checkpoint(run_dir), len(job.steps_logged())
    trained = None  # fault -> the restarted job's first logged row
    while job.p.poll() is None and trained is None:
        trained = time.time() - t0 if len(job.steps_logged()) > rows else None
        time.sleep(0.05)
    rc = job.wait()
    return dict(fault="kill -9 worker 1, max_restarts=2", strategy=strategy, detect_s=job.first("was killed", t0),
                recover_s=trained or restart, exit=rc, steps_lost=max(reached - resumed_from, 0),
                weights_equal=same(run_dir, reference(tmp, strategy)) if rc == 0 else False, orphans=orphans(pids))


def frozen(tmp: Path, strategy: str) -> dict:
    """SIGSTOP of a worker: the others find it silent and the job ends naming it."""
    run_dir = tmp / f"frozen-{strategy}"
    job = Job(run_dir, STRATEGY[strategy] + ["train.steps=100000"])
    pids = job.training(2 if strategy == "allreduce" else 3)
    t0 = time.time()
    os.kill(pids[1], signal.SIGSTOP)
    rc = job.wait()
    named = any("rank 1 (worker 1 on node 2)" in line for _, line in job.lines[-2:])
    return dict(fault="SIGSTOP worker 1", strategy=strategy, detect_s=job.first("rank 1", t0),
                recover_s=time.time() - t0, exit=rc, named_right=named, steps_lost=None, weights_equal=None,
                orphans=orphans(pids))


def killed_launcher(tmp: Path, strategy: str) -> dict:
    """kill -9 of the launcher: its processes die with it."""
    job = Job(tmp / f"launcher-{strategy}", STRATEGY[strategy] + ["train.steps=100000"])
    pids = job.training(3)
    t0 = time.time()
    job.p.kill()
    rc = job.wait()
    while any(alive(p) for p in pids.values()) and time.time() - t0 < 10:
        time.sleep(0.05)
    return dict(fault="kill -9 the launcher", strategy=strategy, detect_s=None, recover_s=time.time() - t0, exit=rc,
                steps_lost=None, weights_equal=None, orphans=orphans(pids))


def lost_node(tmp: Path, strategy: str, sig: signal.Signals, survive: bool = False) -> dict:
    """kill -9 or SIGSTOP of worker 2 (node 3) of an asynchronous job, or of one with cluster.survive_loss:
    it goes on with the others."""
    run_dir = tmp / f"lost-{strategy}-{sig.name}"
    ps = strategy not in ("allreduce", "async-allreduce", "local-sgd", "diloco")
    sets = [f"strategy.name={strategy}", f"cluster.num_ps={int(ps)}", "cluster.nodes=3",
            "strategy.backup_workers=1" if strategy == "backup" else "strategy.backup_workers=0", "train.steps=100",
            *STRATEGY.get(strategy, [])[1:]] + \
        (["cluster.survive_loss=true", "train.checkpoint_every=0"] if survive else [])
    job = Job(run_dir, sets)
    pids = job.training(3 + ps)
    rank = next(r for r, pid in pids.items()
                if json.loads((run_dir / "logs" / f"rank{r}.json").read_text())["index"] == 2
                and json.loads((run_dir / "logs" / f"rank{r}.json").read_text())["role"] == "worker")
    t0 = time.time()
    os.kill(pids[rank], sig)
    declared, rows = None, 0
    while job.p.poll() is None and declared is None:
        declared = job.first("the job goes on without", t0)
        rows = len(job.steps_logged())
        time.sleep(0.05)
    trained = None
    while job.p.poll() is None and trained is None:
        trained = time.time() - t0 if len(job.steps_logged()) > rows else None
        time.sleep(0.05)
    rc = job.wait()
    summary = json.loads((run_dir / "summary.json").read_text()) if rc == 0 else {}
    lost = (summary.get("lost_workers") or [{}])[0]
    row = dict(fault=f"{'kill -9' if sig == signal.SIGKILL else sig.name} worker 2 (node 3)"
               + (", survive_loss" if survive else ""), strategy=strategy, detect_s=declared, recover_s=trained,
               exit=rc, steps_lost=lost.get("steps_lost", 0) if rc == 0 else None, heal_s=lost.get("heal_s"),
               weights_equal=None, target_reached=summary.get("images_applied", 0) >= 100 * 3 * 32,
               lost_workers=summary.get("lost_workers"), orphans=orphans(pids))
    return dict(row, right=rc == 0 and row["target_reached"] and row["orphans"] == 0) if survive else row


def survive_overhead(tmp: Path, repeats: int = 3) -> dict:
    """What cluster.survive_loss costs a step when nothing fails: 4 replicas of allreduce at emulated 0.1 s
    steps, with and without it, alternately; the job's images per second (summary.json) of each run."""
    rates: dict[bool, list] = {False: [], True: []}
    for i in range(repeats):
        for on in (False, True):
            run_dir = tmp / f"overhead-{int(on)}-{i}"
            sets = ["strategy.name=allreduce", "cluster.nodes=4", "train.emulate_compute_s=0.1", "train.steps=60",
                    "train.checkpoint_every=0", f"cluster.survive_loss={str(on).lower()}"]
            if Job(run_dir, sets).wait() != 0:
                raise RuntimeError(f"the run {run_dir.name} failed")
            rates[on].append(json.loads((run_dir / "summary.json").read_text())["images_per_sec"])
    off, on = sorted(rates[False])[repeats // 2], sorted(rates[True])[repeats // 2]
    return dict(fault="none: 4 replicas at 0.1 s steps, survive_loss off and on", strategy="allreduce",
                images_per_sec_off=rates[False], images_per_sec_on=rates[True], overhead=1 - on / off,
                right=on / off >= 0.98)


def goodput(tmp: Path, strategy: str = "allreduce", every_s: float = 30.0, steps: int = 1000) -> dict:
    """A worker killed every `every_s` seconds (nodes 2, 3, 4 in turn) of a 4-node job at emulated 0.1 s
    steps: its goodput (the target's images over the job's wall time, launch to exit, failures included)
    going on in place (survive_loss), with replacements that heal from a live replica where the strategy
    takes them, and when the job restarts from its newest checkpoint (max_restarts, a checkpoint every 50
    steps), against the same job with no failure. Without replacements the job goes on with fewer nodes
    after each loss, until one is left."""
    base = [f"strategy.name={strategy}", "cluster.nodes=4", "train.emulate_compute_s=0.1", f"train.steps={steps}",
            *STRATEGY[strategy][1:]]
    heals = strategy in ("allreduce", "local-sgd", "diloco")
    place = "replace" if heals else "survive"
    modes = {"none": ["train.checkpoint_every=0"],
             place: ["cluster.survive_loss=true", f"cluster.replacements={50 * heals}", "train.checkpoint_every=0"],
             "restart": ["cluster.max_restarts=50", "train.checkpoint_every=50"]}
    out = {}
    for mode, sets in modes.items():
        run_dir = tmp / f"goodput-{strategy}-{mode}"
        job, kills = Job(run_dir, base + sets), 0
        job.training(4 + ("cluster.num_ps=1" in STRATEGY[strategy]), after_step=1)
        t_next = time.time() + every_s
        while job.p.poll() is None:
            if mode != "none" and time.time() >= t_next:
                index = 1 + kills % 3
                try:
                    info = [json.loads(f.read_text()) for f in (run_dir / "logs").glob("rank*.json")]
                    os.kill(next(d["pid"] for d in info if d["role"] == "worker" and d["index"] == index),
                            signal.SIGKILL)
                    kills += 1
                except (OSError, ValueError, StopIteration):
                    pass
                t_next += every_s
            time.sleep(0.1)
        rc, wall = job.wait(), time.time() - job.t0
        summary = json.loads((run_dir / "summary.json").read_text()) if rc == 0 else {}
        out[mode] = dict(exit=rc, kills=kills, wall_s=round(wall, 1), images=summary.get("images_applied"),
                         goodput=round(summary.get("images_applied", 0) / wall, 1),
                         joined=len(summary.get("joined_workers") or []), restarts=sum(
                             "restart" in line and "of" in line for _, line in job.lines))
    ratio = {m: round(out[m]["goodput"] / out["none"]["goodput"], 3) for m in (place, "restart")}
    return dict(fault=f"kill -9 a worker every {every_s:.0f} s, 4 nodes at 0.1 s steps", strategy=strategy,
                runs=out, goodput_ratio=ratio, right=all(r["exit"] == 0 for r in out.values()) and
                (ratio[place] >= 0.9 or not heals))


def lost_shard(tmp: Path, strategy: str) -> dict:
    """kill -9 of PS shard 1 of 2 (node 3) of a 3-node job with cluster.survive_loss: shard 0 takes it on
    (strategies/ps_client.py); the chief's figures of it from summary.json's lost_workers."""
    run_dir = tmp / f"lost-shard-{strategy}"
    sets = [f"strategy.name={strategy}", "cluster.num_ps=2", "cluster.nodes=3", "train.steps=100",
            "cluster.survive_loss=true", "train.checkpoint_every=20"]
    job = Job(run_dir, sets)
    pids = job.training(5, after_step=25)
    rank = next(r for r in pids if json.loads((run_dir / "logs" / f"rank{r}.json").read_text())["role"] == "ps"
                and json.loads((run_dir / "logs" / f"rank{r}.json").read_text())["index"] == 1)
    t0 = time.time()
    os.kill(pids[rank], signal.SIGKILL)
    declared = None
    while job.p.poll() is None and declared is None:
        declared = job.first("taken on by another", t0)
        time.sleep(0.05)
    rc = job.wait()
    summary = json.loads((run_dir / "summary.json").read_text()) if rc == 0 else {}
    lost = (summary.get("lost_workers") or [{}])[0]
    row = dict(fault="kill -9 PS shard 1 of 2 (node 3), survive_loss", strategy=strategy, detect_s=declared,
               exit=rc, heal_s=lost.get("heal_s"), updates_lost=lost.get("updates_lost"),
               taken_on_by=lost.get("taken_on_by"), target_reached=summary.get("images_applied", 0) >= 100 * 3 * 32,
               lost_workers=summary.get("lost_workers"), orphans=orphans(pids))
    return dict(row, right=rc == 0 and row["target_reached"] and row["orphans"] == 0 and "shard" in lost)


def torchrun_replacement(tmp: Path, replace: int = 1) -> dict:
    """Three torchrun agents of an allreduce job with cluster.survive_loss: kill -9 of node 3's worker, which
    its keeper (launch/keep.py) replaces on its node; the times from summary.json's lost and joined rows."""
    run_dir = tmp / f"torchrun-{replace}"
    sets = [*BASE, "strategy.name=allreduce", "cluster.nodes=3", "cluster.survive_loss=true",
            f"cluster.replacements={replace}", "cluster.max_restarts=0", "train.steps=150",
            "train.emulate_compute_s=0.1", "train.checkpoint_every=10"]
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        sets.append(f"cluster.master_port={sk.getsockname()[1]}")
    plan = subprocess.run([sys.executable, "-m", "scaletrain.cli", "plan", "--recipe", "recipes/digits.toml",
                           "--format", "torchrun", "--run-dir", str(run_dir), *(a for x in sets for a in ("--set", x))],
                          cwd=ROOT, capture_output=True, text=True, check=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PATH=f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}")
    agents = [subprocess.Popen(c, shell=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
              for c in plan.stdout.splitlines() if c.startswith("torchrun ")]
    metrics, deadline = run_dir / "metrics.jsonl", time.time() + 120
    while not (metrics.exists() and sum('"train"' in r for r in metrics.read_text().splitlines()) >= 3) \
            and time.time() < deadline:
        time.sleep(0.2)
    worker = next(d for d in (json.loads(f.read_text()) for f in (run_dir / "logs").glob("rank*.json"))
                  if d["role"] == "worker" and d["index"] == 2)
    os.kill(worker["pid"], signal.SIGKILL)
    rcs = [a.wait(timeout=300) for a in agents]
    summary = json.loads((run_dir / "summary.json").read_text())
    lost, joined = (summary.get("lost_workers") or [{}])[0], (summary.get("joined_workers") or [{}])[0]
    ends = {w["weights_sum"] for w in summary["per_worker"]}
    row = dict(fault="kill -9 worker 2 (node 3) under torchrun, survive_loss", strategy="allreduce",
               replacements=replace, agents_exit=rcs, detect_s=lost.get("detect_s"), steps_lost=lost.get("steps_lost"),
               heal_s=lost.get("heal_s"), **{k: joined.get(k) for k in ("start_s", "wait_s", "adopt_s", "pause_s")},
               replicas_at_end=len(summary["per_worker"]), one_model=len(ends) == 1,
               target_reached=summary.get("images_applied", 0) >= 150 * 3 * 32)
    return dict(row, right=rcs == [0, 0, 0] and row["one_model"] and row["target_reached"]
                and row["replicas_at_end"] == 2 + replace)


def smaller_restart(tmp: Path) -> dict:
    """kill -9 of worker 2 of a 3-node allreduce job with cluster.min_nodes=2: it restarts on 2 nodes."""
    run_dir = tmp / "smaller-allreduce"
    job = Job(run_dir, ["strategy.name=allreduce", "cluster.nodes=3", "cluster.min_nodes=2",
                        "cluster.max_restarts=1"])
    pids = job.training(3, after_step=30)
    reached, t0 = job.steps_logged()[-1], time.time()
    os.kill(pids[2], signal.SIGKILL)
    restart = job.until("restart 1 of", t0)
    resumed_from = newest_checkpoint(run_dir)
    rc = job.wait()
    summary = json.loads((run_dir / "summary.json").read_text()) if rc == 0 else {}
    return dict(fault="kill -9 worker 2 (node 3), min_nodes=2", strategy="allreduce",
                detect_s=job.first("was killed", t0), recover_s=restart, exit=rc,
                steps_lost=max(reached - resumed_from, 0), weights_equal=None,
                nodes_after=summary.get("nodes"), target_reached=last_images(run_dir) == 60 * 3 * 32,
                orphans=orphans(pids))


def last_images(run_dir: Path) -> int:
    """The job's images at its last metrics row (summary.json counts from the last resume)."""
    rows = [json.loads(r) for r in (run_dir / "metrics.jsonl").read_text().splitlines() if r.strip()]
    return rows[-1]["images"] if rows else 0


RANK = re.compile(r"rank (\d+) \(")


def named(lines: list) -> int | None:
    """The rank the job's last word on a failure names: the launcher's restart line or its final one."""
    words = [line for _, line in lines if "restart 1 of" in line or "the job failed:" in line]
    found = RANK.search(words[0]) if words else None
    return int(found.group(1)) if found else None


def frozen_named(tmp: Path, name: str, sets: list[str], rank: int, world: int, restart: bool = False) -> dict:
    """SIGSTOP of one process: the job names it (not a process that left because of it, nor one the
    launcher killed); with a restart allowed, the restart leaves the frozen process's node out."""
    run_dir = tmp / name
    steps = ["cluster.min_nodes=2", "cluster.max_restarts=1"] if restart else ["train.steps=100000"]
    job = Job(run_dir, sets + steps)
    pids = job.training(world, after_step=25 if restart else 10)  # with a restart: past the checkpoint of step 20
    node = json.loads((run_dir / "logs" / f"rank{rank}.json").read_text())["node"] + 1
    t0 = time.time()
    os.kill(pids[rank], signal.SIGSTOP)
    rc = job.wait()
    row = dict(fault=f"SIGSTOP rank {rank}" + (", min_nodes=2, max_restarts=1" if restart else ""),
               strategy=sets[0].split("=")[1], detect_s=job.first(f"rank {rank}", t0), recover_s=time.time() - t0,
               exit=rc, rank=rank, named=named(job.lines), orphans=orphans(pids))
    right = row["named"] == rank and row["orphans"] == 0
    if restart:
        summary = json.loads((run_dir / "summary.json").read_text()) if rc == 0 else {}
        row.update(node_left_out=any(f"restart 1 of 1 without node {node} " in line for _, line in job.lines),
                   nodes_after=summary.get("nodes"))
        right = right and rc == 0 and row["node_left_out"] and row["nodes_after"] == 2
    else:
        right = right and rc == 1
    return dict(row, right=right)


def rerun_finished(tmp: Path) -> dict:
    """A finished run's command run again: nothing is overwritten, exit 0."""
    run_dir, sets = tmp / "rerun", ["strategy.name=allreduce", "train.steps=10"]
    if Job(run_dir, sets).wait() != 0:
        raise RuntimeError("the first run failed")
    before = {f: (run_dir / f).read_bytes() for f in ("summary.json", "config.toml")}
    again = Job(run_dir, sets, quiet=False)
    rc = again.wait()
    equal = all((run_dir / f).read_bytes() == b for f, b in before.items())
    said = [line for _, line in again.lines + again.out]
    return dict(fault="the finished run's command again", strategy="allreduce", exit=rc, files_equal=equal,
                said=said[-1] if said else "", right=rc == 0 and equal)


def sigterm_start_up(tmp: Path, after_s: float = 4.0) -> dict:
    """SIGTERM to the launcher a few seconds after launch, while the job starts: a stop (exit 75)."""
    run_dir = tmp / "sigterm-start-up"
    job = Job(run_dir, ["strategy.name=allreduce"], quiet=False)
    time.sleep(max(0.0, job.t0 + after_s - time.time()))
    t0 = time.time()
    phase = ([line for _, line in job.out if line.startswith("start-up: ")] or ["none yet"])[-1]
    trained = bool(job.steps_logged())
    job.p.send_signal(signal.SIGTERM)
    rc = job.wait()
    last = job.lines[-1][1] if job.lines else ""
    said_stop = "stopped" in last and not any("failed" in line for _, line in job.lines)
    return dict(fault=f"SIGTERM to the launcher {after_s:.0f} s after launch", strategy="allreduce",
                phase=phase, trained_before=trained, detect_s=job.first("SIGTERM", t0), recover_s=time.time() - t0,
                exit=rc, said=last, right=rc == 75 and said_stop)


def load(tmp: Path, nodes: int) -> dict:
    """nodes x 2 processes of an allreduce job with emulated compute at the default cluster.timeout_s."""
    run_dir = tmp / f"load-{nodes}x2"
    sets = ["strategy.name=allreduce", f"cluster.nodes={nodes}", "cluster.gpus_per_node=2", "cluster.timeout_s=60",
            "train.emulate_compute_s=0.05", "train.steps=30", "train.checkpoint_every=0"]
    job = Job(run_dir, sets, quiet=False)
    first = None
    while job.p.poll() is None and first is None:
        first = time.time() - job.t0 if job.steps_logged() else None
        time.sleep(0.05)
    rc = job.wait()
    ready = next((line for _, line in job.out if line.startswith("start-up: data ready")), "")
    start = re.search(r"\(([\d.]+) s\)", ready)
    return dict(fault=f"load: {2 * nodes} processes starting on this machine", strategy="allreduce",
                processes=2 * nodes, exit=rc, start_s=float(start.group(1)) if start else None, first_row_s=first,
                total_s=time.time() - job.t0, failure=next((line for _, line in job.lines if "error" in line), None),
                right=rc == 0)


_references: dict[str, Path] = {}


def reference(tmp: Path, strategy: str) -> Path:
    """An uninterrupted run of the same configuration (made once)."""
    if strategy not in _references:
        run_dir = tmp / f"reference-{strategy}"
        if Job(run_dir, STRATEGY[strategy]).wait() != 0:
            raise RuntimeError(f"the uninterrupted {strategy} run failed")
        _references[strategy] = run_dir
    return _references[strategy]


SCENARIOS = {
    "sigterm-launcher": lambda t: stop_signal(t, "allreduce", signal.SIGTERM, to_launcher=True),
    "sigusr1-worker": lambda t: stop_signal(t, "sync", signal.SIGUSR1, to_launcher=False),
    "kill-restart-sync": lambda t: kill_with_restart(t, "sync"),
    "kill-restart-allreduce": lambda t: kill_with_restart(t, "allreduce"),
    "sigstop-allreduce": lambda t: frozen(t, "allreduce"),
    "kill-launcher": lambda t: killed_launcher(t, "sync"),
    "kill-worker-mixed-async": lambda t: lost_node(t, "mixed-async", signal.SIGKILL),
    "kill-worker-async": lambda t: lost_node(t, "async", signal.SIGKILL),
    "kill-worker-backup": lambda t: lost_node(t, "backup", signal.SIGKILL),
    "sigstop-worker-async": lambda t: lost_node(t, "async", signal.SIGSTOP),
    "kill-restart-smaller-allreduce": smaller_restart,
    "sigstop-allreduce-3-nodes": lambda t: frozen_named(t, "sigstop-3", ["strategy.name=allreduce", "cluster.nodes=3"],
                                                        1, 3),
    "sigstop-allreduce-3-nodes-restart": lambda t: frozen_named(t, "sigstop-3-restart",
                                                                ["strategy.name=allreduce", "cluster.nodes=3"], 1, 3,
                                                                restart=True),
    "sigstop-ps-sync": lambda t: frozen_named(t, "sigstop-ps", ["strategy.name=sync", "cluster.num_ps=1"], 2, 3),
    "rerun-finished": rerun_finished,
    "sigterm-start-up": sigterm_start_up,
    "survive-kill-allreduce": lambda t: lost_node(t, "allreduce", signal.SIGKILL, survive=True),
    "survive-sigstop-allreduce": lambda t: lost_node(t, "allreduce", signal.SIGSTOP, survive=True),
    "survive-kill-sync": lambda t: lost_node(t, "sync", signal.SIGKILL, survive=True),
    "survive-overhead": survive_overhead,
    "goodput-kill-every-30s": goodput,
    "goodput-kill-every-30s-local-sgd": lambda t: goodput(t, "local-sgd"),
    "goodput-kill-every-30s-diloco": lambda t: goodput(t, "diloco"),
    "goodput-kill-every-30s-sync": lambda t: goodput(t, "sync"),
    "survive-kill-local-sgd": lambda t: lost_node(t, "local-sgd", signal.SIGKILL, survive=True),
    "survive-kill-diloco": lambda t: lost_node(t, "diloco", signal.SIGKILL, survive=True),
    "survive-kill-async-allreduce": lambda t: lost_node(t, "async-allreduce", signal.SIGKILL, survive=True),
    "survive-kill-ps-sync": lambda t: lost_shard(t, "sync"),
    "survive-kill-ps-mixed-async": lambda t: lost_shard(t, "mixed-async"),
    "replace-kill-torchrun": torchrun_replacement,
    "survive-kill-torchrun": lambda t: torchrun_replacement(t, 0),
    "load-allreduce-8x2": lambda t: load(t, 8),
    "load-allreduce-16x2": lambda t: load(t, 16),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", choices=sorted(SCENARIOS), help="scenarios to run (default: all)")
    ap.add_argument("--save", action="store_true", help="also write benchmarks/results/faults-TIME-COMMIT.json")
    a = ap.parse_args()
    rows, load_before = [], os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.only or SCENARIOS:
            row = {"scenario": name, **{k: round(v, 2) if isinstance(v, float) else v
                                        for k, v in SCENARIOS[name](Path(tmp)).items()}, "load": os.getloadavg()[0]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if a.save:
        save(rows, load_before)


def save(rows: list[dict], load_before: tuple) -> None:
    from scaletrain.metrics import git_commit, run_info
    import torch

    commit, stamp = git_commit(), time.strftime("%Y-%m-%dT%H%MZ", time.gmtime())
    out = ROOT / "benchmarks" / "results" / f"faults-{stamp}-{commit[:7]}.json"
    out.write_text(json.dumps({
        "benchmark": "faults", "command": "python " + " ".join(sys.argv), **run_info(torch.device("cpu")),
        "cpus": os.cpu_count(), "load_before": load_before, "load_after": os.getloadavg(),
        "all_right": all(r.get("right", True) for r in rows), "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
