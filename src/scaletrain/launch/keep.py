"""A rank kept under torchrun and srun: in a job that goes on without a lost process, the process the
agent or the step started runs the job's process as its child and, once the chief has dropped that
rank, starts a replacement (cluster.replacements) in its place, which joins the running job at a
step boundary with a live replica's state (comm/ring.py), as the local launcher does for its own
processes (launch/local.py).

Why not the launcher's own restart: torchrun's agent restarts a failed worker group by a new
rendezvous, and every other agent, seeing a node waiting, restarts its own (torch's
elastic/agent/server/api.py, `_invoke_run`): the whole job starts again. srun restarts no task.
The keeper restarts one process, on the node where it ran; the agent and the step never see it fail.

The child runs a command with KEPT set, so it joins instead of keeping: this process's own command
line (sys.orig_argv) for `scaletrain train` under torchrun and a user's script; for a Slurm task of
the built-in loop, which is this module (`python -m scaletrain.launch.keep RUN_DIR`, launch/slurm.py),
launch/entry.py's. A replacement also has LATE (proc/env.py). Those two keepers import no torch, so
they cost a node little memory and its processes no start-up time; a user's script keeps after its
own imports (job.Job.from_env). The chief's word is RUN_DIR/logs/dropped (comm/liveness.py), on the file system every node shares: a child still running when its rank is
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
A replacement that ends before the chief admits it is itself replaced while the budget lasts.
The keeper passes the job's stop signals on to its child, each as it comes (the child acts on the
first), and its child dies with it. A user's script (job.Job.from_env) runs in both: what it does
before Job.from_env, it does twice.
"""

from __future__ import annotations

if __name__ == "__main__":  # a task of a Slurm step: stop signals held through the imports below
    from ..proc.early import hold

    hold()

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from ..config import load_config
from ..errors import EXIT_PEER, EXIT_STOPPED, PlanError
from ..proc import early, env as launch_env
from ..proc.env import LATE, RANKS, LaunchError, in_slurm_step, in_torchrun
from ..proc.parent import die_with_parent
from ..strategies import traits
from .notes import describe_exit, ranks_in, stop_signals_of, write_ranks

KEPT = "SCALETRAIN_KEPT"  # in the kept child's environment: it joins the job itself
POLL_S = 0.2


def wanted(cfg, env=os.environ) -> bool:
    """Whether this process keeps its rank: one torchrun or srun started (not itself a kept child), in a
    job that goes on without a lost process (strategies/traits.tolerant)."""
    return traits.tolerant(cfg) and (in_torchrun(env) or in_slurm_step(env)) and not env.get(KEPT)


def placed(cfg, node: int | None):
    """(plan, rendezvous) of this process as its launcher placed it, or status 2 (the reason printed)."""
    try:
        plan = launch_env.plan_for(cfg)
        return plan, launch_env.rendezvous(plan, cfg.cluster.master_addr, cfg.cluster.master_port, node)
    except (LaunchError, PlanError) as e:
        print(f"scaletrain: error: {e}", file=sys.stderr, flush=True)
        return 2


def kept(cfg, run_dir: Path, node: int | None, command: list[str] | None = None) -> int:
    """Keep this process's rank (run): the exit status of its last child, which runs `command` (this
    process's own command line by default)."""
    found = placed(cfg, node)
    return found if isinstance(found, int) else run(cfg, run_dir, *found, command or
                                                    [sys.executable, *sys.orig_argv[1:]])


def dropped_since(run_dir: Path, began: float) -> list[int] | None:
    """The ranks the chief dropped (ranks_in), from a note written since `began`: under torchrun no
    launcher clears an earlier run's note from a run directory resumed."""
    path = run_dir / "logs" / "dropped"
    try:
        if path.stat().st_mtime < began:
            return []
    except FileNotFoundError:
        return []
    except OSError:
        return None
    return ranks_in(path)


def take_one(run_dir: Path, job: str, budget: int) -> int:
    """The number (1..budget) of the replacement this keeper may start, 0 when the job's are spent."""
    for k in range(1, budget + 1):
        try:
            os.close(os.open(run_dir / "logs" / f"replacement-{job}-{k}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return k
        except FileExistsError:
            continue
    return 0


def budget(cfg, rdzv) -> int:
    """cluster.replacements, or 0 where a replacement could not join: torchrun without its agent's store
    (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, comm/groups.py), said once by the chief's keeper."""
    if rdzv.launcher != "torchrun" or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" or \
            not cfg.cluster.replacements:
        return cfg.cluster.replacements
    if rdzv.rank == 0:
        print(f"scaletrain: warning: cluster.replacements = {cfg.cluster.replacements}: this torchrun shares no "
              "store of its agent with the job (TORCH_DISABLE_SHARE_RDZV_TCP_STORE), so no replacement can join; "
              "the job goes on without a lost process", file=sys.stderr, flush=True)
    return 0


def status(rc: int) -> int:
    """A child's end as a shell gives it: 128 + N for one killed by signal N."""
    return 128 - rc if rc < 0 else rc


def run(cfg, run_dir: Path, plan, rdzv, command: list[str]) -> int:
    """Keep rank rdzv.rank of the job to its end, each child running `command`; the exit status of the last."""
    rank, grace, allowed = rdzv.rank, cfg.cluster.timeout_s + 5, budget(cfg, rdzv)
    sigs = sorted({*stop_signals_of(cfg.cluster.stopping), signal.SIGINT})
    got: list[int] = []
    child: list[subprocess.Popen] = []
    exited = run_dir / "logs" / f"exited-{rank}"

    def forward(signum, _frame):
        # Passed on as it came, each time: a stop signal can come more than once (under Slurm, to every
        # process of the step and again from the batch step), and the child acts on the first.
        got.append(signum)
        if child and child[-1].poll() is None:
            child[-1].send_signal(signum)

    before = {s: signal.signal(s, forward) for s in sigs}
    came = early.take(before)
    got += [came] if came in sigs else []
    # A note from before this keeper is an earlier run's, but for a replacement, which a drop started
    keeper, began = os.getpid(), 0.0 if rdzv.late else time.time()

    def start(late: bool) -> subprocess.Popen:
        env = dict(os.environ, **{KEPT: "1"}, **({LATE: str(time.time())} if late else {}))
        p = subprocess.Popen(command, env=env, preexec_fn=lambda: (
            die_with_parent(keeper), signal.pthread_sigmask(signal.SIG_BLOCK, sigs)))
        if got:  # a stop that came before it started: the same stop at its first sync point
            p.send_signal(got[0])
        return p

    def is_dropped(known: bool) -> bool:
        now = dropped_since(run_dir, began)
        return known if now is None else rank in now

    try:
        child.append(start(False))
        joining = rdzv.late  # a keeper a launcher started as a replacement (start_orphans)
        answered = frozen = dropped = False  # frozen: this keeper killed its child, dropped while still running
        while True:
            rc = child[-1].poll()
            dropped = is_dropped(dropped)
            if dropped and not answered:  # this keeper is alive: the launcher leaves the rank to it (Orphans)
                (run_dir / "logs" / f"kept-{rank}").write_text(f"{time.time()}\n")
            answered, was_joining = dropped, joining
            joining = joining and dropped  # admitted: a member again, which a later drop lists anew
            if rc is None:
                if dropped and not joining:  # frozen, or woken too late: the job went on without it
                    child[-1].kill()
                    frozen = True
                time.sleep(POLL_S)
                continue
            if rc in (0, EXIT_STOPPED, 130) or got:
                return status(rc)
            how = describe_exit(plan, rank, None if frozen else rc)
            if was_joining:  # the job went on without the rank and goes on so: another, or none
                print(f"scaletrain: the replacement for {plan.describe(rank)} ended before it joined "
                      f"({how.split(') ', 1)[1]})", file=sys.stderr, flush=True)
            elif not dropped and (rc > 0 and rc != EXIT_PEER or
                                  not traits.survivable(cfg, plan, set(traits.lost_with(plan, rank)))):
                return status(rc)  # a failure the process said (its peers heard it), or one the job cannot go on from
            if not dropped and rc < 0:  # dead for sure: the chief drops it at once (comm/liveness.py)
                write_ranks(run_dir, exited.name, [rank])
            deadline = time.monotonic() + grace  # the chief's word comes within cluster.timeout_s
            while not dropped and time.monotonic() < deadline and not got:
                time.sleep(POLL_S)
                dropped = is_dropped(dropped)
            if not dropped or got:
                return status(rc)
            k = take_one(run_dir, rdzv.job, allowed)
            if not k:  # its part of the job is over: the launcher must not take it for the job's failure
                print(f"scaletrain: {how}; the job goes on without it", file=sys.stderr, flush=True)
                return 0
            exited.unlink(missing_ok=True)  # before it runs: the chief must not drop it again
            child.append(start(True))
            joining, frozen = True, False
            print(f"scaletrain: {how}; started a replacement on this node ({k}/{allowed}); it joins at a step "
                  "boundary", file=sys.stderr, flush=True)
    finally:
        if child and child[-1].poll() is None:  # never left behind this process
            child[-1].kill()
            child[-1].wait()
        exited.unlink(missing_ok=True)  # said for the chief: not for a replacement another launcher starts
        for s, h in before.items():
            signal.signal(s, h)


class Orphans:
    """Ranks the chief dropped whose keeper did not answer within `wait_s` (logs/kept-R): gone with
    their task or their node. The launcher of the job's step (launch/slurm.py) starts them again. The
    answer is weighed against the `dropped` note's time, both stamped by the file system that holds
    them, not against this host's clock."""

    def __init__(self, run_dir: Path, wait_s: float = 5.0) -> None:
        self.run_dir, self.wait_s = run_dir, wait_s
        self.seen: dict[int, tuple[float, float]] = {}  # rank -> (first seen dropped, the note's time then)
        self.taken: set[int] = set()  # handed to the launcher, until the chief admits them or drops them anew

    def poll(self, now: float | None = None) -> list[int]:
        """The ranks orphaned since the last call."""
        now = time.time() if now is None else now
        path = self.run_dir / "logs" / "dropped"
        listed = ranks_in(path)
        try:
            written = path.stat().st_mtime
        except OSError:
            written = None
        if listed is None or listed and written is None:  # not read now: nothing learnt
            return []
        for r in set(self.seen) - set(listed):  # admitted (a replacement joined): a later drop counts anew
            del self.seen[r]
            self.taken.discard(r)
        for r in listed:
            self.seen.setdefault(r, (now, written))
        out = sorted(r for r, (t, w) in self.seen.items()
                     if r not in self.taken and now - t > self.wait_s and not self._answered(r, w))
        self.taken.update(out)
        return out

    def _answered(self, rank: int, written: float) -> bool:
        try:  # written after the drop it answers; the note may have been written again since, for another
            return (self.run_dir / "logs" / f"kept-{rank}").stat().st_mtime >= written - 2.0
        except OSError:
            return False


def start_orphans(ranks: list[int], plan, cfg, hosts: list[str], spares: list[str], run_dir: Path, job: str,
                  srun: list[str], env: dict) -> list[subprocess.Popen]:
    """Start again, as replacements, the dropped ranks no keeper answered for (Orphans: their
    task or their node is gone), a step of one node for each plan node's: on its own host while Slurm
    holds it up, else on a spare host of the allocation, while cluster.replacements lasts."""
    steps = []
    for node in sorted({plan.procs[r].node for r in ranks}):
        mine = [r for r in ranks if plan.procs[r].node == node]
        host = hosts[node] if node_up(hosts[node]) else next((h for h in spares if node_up(h)), None)
        given = [r for r in mine if host and take_one(run_dir, f"slurm-{job}", cfg.cluster.replacements)]
        who = ", ".join(plan.describe(r) for r in mine)
        if not given or host is None:
            print(f"scaletrain: {who}: no keeper answered for it (its task or its node is gone); the job goes on "
                  f"without it ({'no host of the allocation is up' if host is None else 'no replacement left'})",
                  flush=True)
            continue
        if host in spares:
            spares.remove(host)
        print(f"scaletrain: {who}: no keeper answered for it (its task or its node is gone); started a "
              f"replacement step on {host}; it joins at a step boundary", flush=True)
        for r in given:  # a keeper's note of an earlier loss: the chief must not drop the replacement again
            (run_dir / "logs" / f"exited-{r}").unlink(missing_ok=True)
        step_env = {k: v for k, v in env.items() if k != "SLURM_HOSTFILE"}
        step_env.update({RANKS: ",".join(map(str, given)), LATE: str(time.time())})
        steps.append(subprocess.Popen([*srun[:1], "--nodes=1", f"--ntasks={len(given)}", f"--nodelist={host}",
                                       *srun[1:]], env=step_env))
    return steps


def node_up(host: str) -> bool:
    """Whether Slurm holds `host` up: not down, drained, failing or silent."""
    r = subprocess.run(["scontrol", "-o", "show", "node", host], capture_output=True, text=True)
    state = re.search(r"\bState=(\S+)", r.stdout)
    return not r.returncode and state is not None and \
        not re.search(r"DOWN|DRAIN|FAIL|NOT_RESPONDING|\*", state.group(1))


def main(argv: list[str]) -> int:
    """`python -m scaletrain.launch.keep RUN_DIR [ENTRY FLAGS]`: keep this Slurm task's rank, each child
    running `python -m scaletrain.launch.entry RUN_DIR [ENTRY FLAGS]`."""
    run_dir = Path(argv[0])
    return kept(load_config(run_dir / "config.toml"), run_dir, None,
                [sys.executable, "-m", "scaletrain.launch.entry", *argv])


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
