"""A rank kept under torchrun and srun: in a job that goes on without a lost process, the process the
agent or the step started runs the job's process as its child and, once the chief has dropped that
rank, starts a replacement (cluster.replacements) in its place, which joins the running job at a
step boundary with a live replica's state (comm/ring.py), as the local launcher does for its own
processes (launch/local.py).

Why not the launcher's own restart: torchrun's agent restarts a failed worker group by a new
rendezvous, and every other agent, seeing a node waiting, restarts its own (torch's
elastic/agent/server/api.py, `_invoke_run`): the whole job starts again. srun restarts no task.
The keeper restarts one process, on the node where it ran; the agent and the step never see it fail.

The child runs this process's own command line (sys.orig_argv) with KEPT set, so it joins instead of
keeping; a replacement also has LATE (proc/env.py). The chief's word is RUN_DIR/logs/dropped
(comm/liveness.py), on the file system every node shares: a child still running when its rank is
dropped (frozen, or woken too late) is killed, and a dropped child that ended is replaced while the
job's budget lasts: one file logs/replacement-JOB-K each, made exclusively, K up to
cluster.replacements, so the budget is the job's whatever node a replacement runs on. Past it, the
keeper ends with status 0: the job goes on without the rank, and an agent that reported a failure
would hold the others at torchrun's exit barrier and fail them (seen with a worker killed under
survive_loss, no keeper: every agent exited 1). A child that failed otherwise (an exit status of its
own, or a rank the job cannot go on without) ends the keeper at once with its status, for the
launcher to act on.
A child killed by a signal, in a rank the job may go on without, is said in logs/exited-R: the chief
drops it at once, as after the local launcher's note, instead of after cluster.timeout_s of silence.
The keeper passes the job's stop signals on to its child, and its child dies with it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ..errors import EXIT_STOPPED
from ..proc import early
from ..proc.env import LATE, in_slurm_step, in_torchrun
from ..proc.parent import die_with_parent
from ..strategies import traits
from .local import describe_exit, read_ranks, stop_signals_of, write_ranks

KEPT = "SCALETRAIN_KEPT"  # in the kept child's environment: it joins the job itself
POLL_S = 0.2


def wanted(cfg, env=os.environ) -> bool:
    """Whether this process keeps its rank: one torchrun or srun started (not itself a kept child), in a
    job that goes on without a lost process (strategies/traits.tolerant)."""
    return traits.tolerant(cfg) and (in_torchrun(env) or in_slurm_step(env)) and not env.get(KEPT)


def dropped_since(run_dir: Path, began: float) -> list[int]:
    """The ranks the chief dropped, from a note written since `began`: under torchrun no launcher clears
    an earlier run's note from a run directory resumed."""
    try:
        if (run_dir / "logs" / "dropped").stat().st_mtime < began:
            return []
    except OSError:
        return []
    return read_ranks(run_dir, "dropped")


def take_one(run_dir: Path, job: str, budget: int) -> int:
    """The number (1..budget) of the replacement this keeper may start, 0 when the job's are spent."""
    for k in range(1, budget + 1):
        try:
            os.close(os.open(run_dir / "logs" / f"replacement-{job}-{k}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return k
        except FileExistsError:
            continue
    return 0


def run(cfg, run_dir: Path, plan, rdzv) -> int:
    """Keep rank rdzv.rank of the job to its end; the exit status of its last child."""
    rank, grace = rdzv.rank, cfg.cluster.timeout_s + 5
    sigs = sorted({*stop_signals_of(cfg.cluster.stopping), signal.SIGINT})
    got: list[int] = []
    child: list[subprocess.Popen] = []

    def forward(signum, _frame):
        got.append(signum)
        if child and child[-1].poll() is None:
            child[-1].send_signal(signum if len(got) == 1 else signal.SIGKILL)

    before = {s: signal.signal(s, forward) for s in sigs}
    came = early.take(before)
    got += [came] if came in sigs else []
    # A note from before this keeper is an earlier run's, but for a replacement, which a drop started
    keeper, began = os.getpid(), 0.0 if rdzv.late else time.time()

    def start(late: bool) -> subprocess.Popen:
        env = dict(os.environ, **{KEPT: "1"}, **({LATE: str(time.time())} if late else {}))
        p = subprocess.Popen([sys.executable, *sys.orig_argv[1:]], env=env, preexec_fn=lambda: (
            die_with_parent(keeper), signal.pthread_sigmask(signal.SIG_BLOCK, sigs)))
        if got:  # a stop that came before it started: the same stop at its first sync point
            p.send_signal(got[0])
        return p

    try:
        child.append(start(False))
        joining = rdzv.late  # a keeper a launcher started as a replacement (launch/slurm.start_orphans)
        answered = frozen = False  # frozen: this keeper killed its child, dropped while still running
        while True:
            rc = child[-1].poll()
            dropped = rank in dropped_since(run_dir, began)
            if dropped and not answered:  # this keeper is alive: the launcher leaves the rank to it (Orphans)
                (run_dir / "logs" / f"kept-{rank}").write_text(f"{time.time()}\n")
            answered, joining = dropped, joining and dropped  # admitted: a member again, which a later drop lists anew
            if rc is None:
                if dropped and not joining:  # frozen, or woken too late: the job went on without it
                    child[-1].kill()
                    frozen = True
                time.sleep(POLL_S)
                continue
            if rc in (0, EXIT_STOPPED, 130) or got:
                return rc
            if joining:
                print(f"scaletrain: the replacement for {plan.describe(rank)} ended before it joined "
                      f"({describe_exit(plan, rank, rc).split(') ', 1)[1]})", file=sys.stderr, flush=True)
                return rc
            if not dropped and (rc > 0 or not traits.survivable(cfg, plan, set(traits.lost_with(plan, rank)))):
                return rc  # a failure the process said (its peers heard it), or one the job cannot go on from
            if not dropped:  # dead for sure: the chief drops it at once (comm/liveness.py), no silence waited out
                write_ranks(run_dir, f"exited-{rank}", [rank])
            deadline = time.monotonic() + grace  # the chief's word comes within cluster.timeout_s
            while not dropped and time.monotonic() < deadline:
                time.sleep(POLL_S)
                dropped = rank in dropped_since(run_dir, began)
            if not dropped:
                return rc
            k = take_one(run_dir, rdzv.job, cfg.cluster.replacements)
            how = describe_exit(plan, rank, None if frozen else rc)
            if not k:  # its part of the job is over: the launcher must not take it for the job's failure
                print(f"scaletrain: {how}; the job goes on without it", file=sys.stderr, flush=True)
                return 0
            (run_dir / "logs" / f"exited-{rank}").unlink(missing_ok=True)  # before it runs: not dropped again
            child.append(start(True))
            joining, frozen = True, False
            print(f"scaletrain: {how}; started a replacement on this node ({k}/{cfg.cluster.replacements}); it joins "
                  "at a step boundary", file=sys.stderr, flush=True)
    finally:
        if child and child[-1].poll() is None:  # never left behind this process
            child[-1].kill()
            child[-1].wait()
        for s, h in before.items():
            signal.signal(s, h)


class Orphans:
    """Ranks the chief dropped whose keeper did not answer within `wait_s` (logs/kept-R): gone with
    their task or their node. The launcher of the job's step (launch/slurm.py) starts them again."""

    def __init__(self, run_dir: Path, wait_s: float = 5.0) -> None:
        self.run_dir, self.wait_s = run_dir, wait_s
        self.seen: dict[int, float] = {}  # rank -> when this launcher first saw it dropped
        self.taken: set[int] = set()  # handed to the launcher, until the chief admits them or drops them anew

    def poll(self, now: float | None = None) -> list[int]:
        """The ranks orphaned since the last call."""
        now = time.time() if now is None else now
        dropped = set(read_ranks(self.run_dir, "dropped"))
        for r in set(self.seen) - dropped:  # admitted (a replacement joined): a later drop counts anew
            del self.seen[r]
            self.taken.discard(r)
        for r in dropped:
            self.seen.setdefault(r, now)
        out = sorted(r for r, t in self.seen.items()
                     if r not in self.taken and now - t > self.wait_s and not self._answered(r, t))
        self.taken.update(out)
        return out

    def _answered(self, rank: int, since: float) -> bool:
        try:  # its keeper writes it as it sees the drop, which it may see a poll before the launcher does
            return (self.run_dir / "logs" / f"kept-{rank}").stat().st_mtime >= since - 2.0
        except OSError:
            return False
