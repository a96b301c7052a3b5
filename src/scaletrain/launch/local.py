"""The local launcher: every process of the plan on this machine.

Emulated nodes are groups of processes; the rendezvous listens on loopback.
Rank 0 (the chief) writes to this terminal, the others to RUN_DIR/logs/.
The processes are forks of one process that imported torch once (fork.py, starter.py).

Failures: when a process fails, the others get cluster.timeout_s + 5 s to
notice and exit on their own (their logs then name the lost rank), then are
killed. A process that exits with errors.EXIT_PEER left because of another
one; it names them (RUN_DIR/logs/rankR.lost); when they are still running they
are frozen, and are killed at once (without a note, those still running a
few seconds after the first such exit are taken for frozen). Unless the kernel
shows them stopped, such a note is first weighed against the others' for a few
seconds (LISTEN_S): a node cut off from the network (a partition, e.g. the
twin's `scaletrain twin down`) loses the store and names rank 0 while the
others name it, and the node named by the most others is the culprit (between
two nodes, not the chief's); a note from a node the chief declared dropped
counts for nothing. The launcher names the first process that failed or went
silent, not one that left because of it, nor one it killed itself (rank 0
stays a moment after it leaves, serving the store, and may be killed then).
A worker node the job
may go on without (strategies/traits.survivable) may end any way: the launcher waits
for the chief's word (RUN_DIR/logs/dropped, see comm/liveness.py), kills what of
it still runs, and the job's status is that of the others. With
cluster.replacements it then starts a replacement of each dropped rank, which
joins the running job with a live replica's state (comm/ring.py); it is not
killed while the note still lists its rank, until the chief admits it.

Signals: the job's stop signals and Ctrl-C are passed on to every process,
which checkpoint at the next sync point and exit (errors.EXIT_STOPPED, or 130); a
second one kills them at once. Each process holds them (blocked) from its
start until its handlers are in place, so one sent during start-up is the same
stop at the first sync point, not a process killed half-started. Every
process has the kernel's parent-death signal set to SIGKILL (toward its
starter, and the starter toward the launcher): whatever kills the launcher,
even kill -9, takes its processes with it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from functools import partial
from pathlib import Path

from ..config import Config, dump_toml
from ..device import facts
from ..errors import EXIT_PEER, EXIT_STOPPED
from ..metrics import LAUNCHED, start_up
from ..plan import Plan, node_name
from ..strategies import traits
from .. import twin as twins
from ..proc import early
from ..proc.env import LATE, LaunchError, plan_for, script_env
from ..proc.parent import die_with_parent
from .fork import Forked, Starter
from .notes import describe_exit, read_ranks, stop_signals_of, write_ranks


def free_port(addr: str) -> int:
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def check_port(addr: str, port: int, host: str = "") -> None:
    """LaunchError naming cluster.master_port when the rendezvous could not listen on addr:port
    (host: this host's name in the message, where addr is every interface's "")."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((addr, port))
        except OSError as e:
            raise LaunchError(f"cluster.master_port = {port}: cannot listen on {host or addr}:{port} ({e.strerror}); "
                              "choose another port or 0 for a free one") from None


FROZEN_S = 5.0  # after the first process left because of a peer, those still running this long are frozen
# A process that left naming peers still running, which the kernel does not show stopped, is believed after
# this long unless those peers show their own view: a partition is seen from both sides, each side within
# comm/liveness.py's STALE_S (3 s) and a few beats of the other.
LISTEN_S = 7.0


def _child_setup(held: list[int], launcher: int) -> None:
    """In the process starter, before exec: the kernel kills it when the launcher dies, however it
    dies; and the stop signals are held (blocked, so they wait pending) in it and in every process it
    forks until the process has its handlers (comm.end.catch_stop_signals): one forwarded while a process
    still meets the others would kill it, and the launcher would take that for a failure."""
    die_with_parent(launcher)
    signal.pthread_sigmask(signal.SIG_BLOCK, held)


def launch(cfg: Config, run_dir: Path, resume: bool = False, progress: bool = True,
           script: list[str] | None = None) -> int:
    """Start every process of cfg's job here and watch them; the job's exit status. script: the
    user's script and its arguments, which each process runs (job.Job.from_env), instead of the
    built-in loop."""
    plan = plan_for(cfg, facts())
    netns = cfg.cluster.network == "netns"
    if netns:  # the cluster twin: node 1 holds the rendezvous, on an address and a port of its own
        cfg = cfg.replace(**{"cluster.master_addr": twins.address(0), "cluster.ifname": twins.IFNAME,
                             "cluster.master_port": cfg.cluster.master_port or twins.PORT})
    addr = cfg.cluster.master_addr
    if cfg.cluster.master_port and not netns:
        check_port(addr, cfg.cluster.master_port)
    cfg = cfg.replace(**{"cluster.master_port": cfg.cluster.master_port or free_port(addr)})
    held = stop_signals_of(cfg.cluster.stopping)
    # Held here too until _Forward's handlers are in place: one that came while the processes are
    # being started would kill the launcher, not stop the job.
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        came = early.take()  # held from here: _Forward's handlers take the next one
        if came:  # during start-up (proc/early.py): no process started, nothing to checkpoint
            raise early.stopped(came, run_dir)
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        twin = twins.for_job(cfg.cluster, plan.nodes_total, run_dir, partial(_say, progress)) if netns else None
        try:
            return _start(cfg, plan, addr, run_dir, resume, progress, held, script, twin)
        finally:
            if twin is not None:
                twin.close()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def _say(progress: bool, what: str) -> None:
    if progress:
        print(start_up(what), flush=True)


def _start(cfg: Config, plan: Plan, addr: str, run_dir: Path, resume: bool, progress: bool, held: list[int],
           script: list[str] | None, twin=None) -> int:
    launched = time.time()

    def say(what: str, since: float | None = launched) -> None:
        if progress:
            print(start_up(what, since), flush=True)

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "logs").mkdir(exist_ok=True)
    for note in [*(run_dir / "logs").glob("rank*.lost"), run_dir / "logs" / "dropped",
                 run_dir / "logs" / "exited"]:  # an earlier attempt's
        note.unlink(missing_ok=True)
    (run_dir / "config.toml").write_text(dump_toml(cfg))
    threads = max(1, (os.cpu_count() or 1) // plan.world_size)
    job = f"local-{os.getpid()}-{time.time_ns()}"  # names the rendezvous: no other job shares it
    common = dict(os.environ, WORLD_SIZE=str(plan.world_size), MASTER_ADDR=addr, SCALETRAIN_JOB=job,
                  MASTER_PORT=str(cfg.cluster.master_port), OMP_NUM_THREADS=str(threads), **{LAUNCHED: str(launched)})
    if twin is not None and "TORCH_CPP_LOG_LEVEL" not in os.environ:
        # No resolver knows the twin's addresses: c10d's store would warn, at every connection, that it
        # cannot name its client. Its errors still show. Read as torch is imported: the starter's env.
        common["TORCH_CPP_LOG_LEVEL"] = "ERROR"
    argv = [str(run_dir)] + (["--resume"] if resume else []) + ([] if progress else ["--quiet"])
    if script:
        common.update(script_env(run_dir, resume))
    specs = [{"argv": argv, "script": script, "log": str(run_dir / "logs" / f"rank{p.rank}.log") if p.rank else None,
              "netns": twin.node_ns(p.node) if twin else None,
              "env": dict(common, RANK=str(p.rank), LOCAL_RANK=str(p.local_rank),
                          SCALETRAIN_THREADS=str(max(threads, cfg.cluster.ps_threads) if p.role == "ps" else threads))}
             for p in plan.procs]
    say(f"starting {plan.world_size} processes", None)
    starters = [Starter(run_dir, common, partial(_child_setup, held, os.getpid()))]

    def replace(rank: int, k: int) -> Forked:
        """The k-th replacement of a dropped rank (cluster.replacements): it joins the running job and takes a
        live replica's state (comm/ring.py). Its log beside the lost process's, which is kept."""
        spec = dict(specs[rank], log=str(run_dir / "logs" / f"rank{rank}.{k}.log"),
                    env=dict(specs[rank]["env"], **{LATE: str(time.time())}))
        starters.append(Starter(run_dir, common, partial(_child_setup, held, os.getpid())))
        return starters[-1].start([spec])[0]

    try:
        procs = list(starters[0].start(specs))  # its own list: a replacement takes a place in this one
        say(f"{len(procs)}/{plan.world_size} processes up")
        return _watch(plan, procs, cfg.cluster.timeout_s + 5, run_dir, cfg.cluster.stopping,
                      lambda lost: traits.survivable(cfg, plan, lost), replace, cfg.cluster.replacements)
    finally:
        for s in starters:
            s.close()


class _Forward:
    """The launcher's handler of stop signals: pass the first on, kill on the second."""

    def __init__(self, procs: list[Forked], names: tuple[str, ...]) -> None:
        self.procs, self.signal, self.killed = procs, None, False
        self.sigs = stop_signals_of(names)

    def __call__(self, signum, frame) -> None:
        if self.signal is None:
            self.signal = signum
            print(f"scaletrain: {signal.Signals(signum).name}: every process checkpoints at the next sync point "
                  "and stops (send it again to stop at once)", file=sys.stderr, flush=True)
            _stop(self.procs, signum)
        else:
            self.killed = True
            _stop(self.procs, signal.SIGKILL)

    def __enter__(self):
        self.before = {s: signal.signal(s, self) for s in self.sigs}
        signal.pthread_sigmask(signal.SIG_UNBLOCK, self.sigs)  # one held by launch() is forwarded now
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self.before.items():
            signal.signal(s, h)


def _watch(plan: Plan, procs: list[Forked], grace: float, run_dir: Path, stop_signals: tuple[str, ...],
           survivable=lambda lost: False, replace=None, replacements: int = 0) -> int:
    """Wait for every process; returns 0, EXIT_STOPPED or 130 (stopped on request), else 1. replace(rank, k):
    start the k-th replacement of a rank the chief dropped, up to `replacements` in all."""
    failed = left = None  # (rank, time): the first own failure; the first exit because of a peer
    frozen: list[int] = []
    spared: list[int] = []  # ended, in a node the job may go on without: the chief's to declare
    killed: set[int] = set()  # killed by this launcher while running: their end is not their failure
    leavers: set[int] = set()  # left because of a peer (EXIT_PEER): never the culprit while another is
    doubted: dict[int, float] = {}  # left naming peers that still run, not stopped: rank -> when; judged (_judge)
    cut = None  # (rank, what): the node the others could not reach, and it them
    replaced: list[int] = []  # the ranks replaced, once per replacement
    joining: set[int] = set()  # replaced, still listed dropped until the chief admits the replacement

    def kill(ranks) -> None:
        # Rank 0 stays a moment after it leaves (it serves the store): killed then, it did not fail.
        killed.update(r for r in ranks if procs[r].poll() is None)
        _stop([procs[r] for r in ranks], signal.SIGKILL)

    everyone = range(len(procs))
    with _Forward(procs, stop_signals) as fwd:
        while True:
            running = any(p.poll() is None for p in procs)  # taken first: the last sweep sees every exit
            now = time.time()
            dropped = read_ranks(run_dir, "dropped")
            joining &= set(dropped)  # admitted: a member again, which a later drop lists anew
            for rank in [r for r in joining if procs[r].poll() is not None]:  # ended before it joined
                joining.discard(rank)
                print(f"scaletrain: the replacement for {plan.describe(rank)} ended before it joined "
                      f"({describe_exit(plan, rank, procs[rank].poll()).split(') ', 1)[1]})", file=sys.stderr, flush=True)
            kill([r for r in dropped if r not in joining])  # frozen, or woken too late: the job went on
            for rank in dropped:  # dropped and ended (killed, or exited): replaced while the budget lasts
                if rank not in joining and procs[rank].poll() not in (None, 0) and len(replaced) < replacements and \
                        not fwd.signal and failed is None and running:
                    replaced.append(rank)
                    killed.discard(rank)
                    if rank in spared:
                        spared.remove(rank)
                        write_ranks(run_dir, "exited", spared)  # before it runs: the chief must not drop it again
                    procs[rank] = replace(rank, replaced.count(rank))
                    joining.add(rank)
                    print(f"scaletrain: started a replacement for {plan.describe(rank)} "
                          f"({len(replaced)}/{replacements}); it joins at a step boundary", file=sys.stderr,
                          flush=True)
            for rank in dropped:  # the chief went on without it: its view of who was lost prevails
                doubted.pop(rank, None)
            for rank, p in enumerate(procs):
                rc = p.poll()
                if rc in (None, 0, EXIT_STOPPED, 130) or fwd.killed or \
                        rank in killed.union(frozen, dropped, spared, leavers, doubted, joining):
                    continue
                # A process that left naming a peer still running left because that one is frozen: so
                # it did in a node the job could go on without too (a frozen chief, which serves the
                # store, ends every process).
                named = [r for r in read_ranks(run_dir, f"rank{rank}.lost") if procs[r].poll() is None] \
                    if rc == EXIT_PEER else []
                if failed is None and not named and survivable(set(dropped + spared + traits.lost_with(plan, rank))):
                    spared.append(rank)
                    write_ranks(run_dir, "exited", spared)  # the chief drops them at once (comm/liveness.py)
                    print(f"scaletrain: {describe_exit(plan, rank, rc)}; the job may go on without "
                          f"{'it' if plan.procs[rank].role == 'ps' else node_name(plan.procs[rank].node)}",
                          file=sys.stderr, flush=True)
                elif rc == EXIT_PEER and failed is None and not frozen and cut is None and \
                        (doubted or named and not _stopped(procs, named)):
                    doubted[rank] = now  # cut off from them, or they from the job: the others' view tells
                elif rc == EXIT_PEER:
                    left = left or (rank, now)
                    leavers.add(rank)
                    if named and failed is None and not frozen and cut is None:
                        frozen = named
                        kill(everyone)
                elif failed is None and cut is None:
                    failed = (rank, now)
                    print(f"scaletrain: {describe_exit(plan, rank, rc)}; waiting up to {grace:.0f} s for the "
                          "others to stop", file=sys.stderr, flush=True)
            if doubted and failed is None and not frozen and cut is None:
                verdict = _judge(plan, run_dir, doubted, dropped, now, final=not running)
                if isinstance(verdict, int):  # no other view came: the peers it named are frozen
                    left = left or (verdict, doubted[verdict])
                    frozen = [r for r in read_ranks(run_dir, f"rank{verdict}.lost") if procs[r].poll() is None]
                elif verdict is not None:  # said once, as the job's failure or its restart
                    cut = verdict
                if verdict is not None:
                    leavers.update(doubted)
                    doubted.clear()
                    kill(everyone)
            if failed is None and not frozen and left is not None and now - left[1] > FROZEN_S:
                frozen = [r for r, p in enumerate(procs) if p.poll() is None]
                kill(everyone)
            if failed is not None and now - failed[1] > grace:
                kill(everyone)
            if not running:
                break
            time.sleep(0.2)
    if fwd.killed:
        print("scaletrain: stopped at once by a second signal: no checkpoint at this step", file=sys.stderr)
        return 130 if fwd.signal == signal.SIGINT else 128 + fwd.signal
    undeclared = [r for r in spared if r not in dropped]
    if cut is not None and not failed:
        write_failure(run_dir, plan, *cut)
        return 1
    culprit = undeclared[0] if undeclared and (failed or frozen or left) else \
        failed[0] if failed else frozen[0] if frozen else left[0] if left else None
    if culprit is not None:
        rc = None if culprit in frozen else procs[culprit].returncode
        write_failure(run_dir, plan, culprit, describe_exit(plan, culprit, rc))
        return 1
    codes = {p.returncode for r, p in enumerate(procs) if r not in dropped + spared}
    return 130 if 130 in codes else EXIT_STOPPED if EXIT_STOPPED in codes else 0


def _stopped(procs, ranks: list[int]) -> bool:
    """Whether the kernel shows one of ranks stopped (SIGSTOP, a debugger): frozen beyond doubt."""
    for r in ranks:
        try:
            with open(f"/proc/{procs[r].pid}/stat") as fh:
                if fh.read().rsplit(")", 1)[1].split()[0] in "tT":
                    return True
        except (OSError, IndexError):
            pass
    return False


def _judge(plan: Plan, run_dir: Path, doubted: dict[int, float], dropped: list[int], now: float,
           final: bool = False):
    """The view of the majority on processes that left naming peers still running (doubted: rank -> when).

    Each process that left wrote whom it lost (rankR.lost); so does one still lingering (rank 0 serves the
    store a moment after). A node whose processes lost contact with another node that lost contact with them
    is a partition: the node named by the most other nodes was cut off; between two, the one without the
    chief (its side holds the job's store). Returns (rank, what) for a partition, a doubted rank to believe
    (its peers are frozen: no other view came within LISTEN_S, or every process ended), or None to wait."""
    node = [p.node for p in plan.procs]
    views = {r: [x for x in read_ranks(run_dir, f"rank{r}.lost") if x not in dropped]
             for r in range(plan.world_size) if r not in dropped}
    accused: dict[int, set[int]] = {}  # node -> the nodes its processes lost
    for r, lost in views.items():
        accused.setdefault(node[r], set()).update(node[x] for x in lost)
    cut = cut_node(accused, plan.workers[0].node)
    if cut is not None:
        ranks = [p.rank for p in plan.procs if p.node == cut]
        rank = min(ranks, key=lambda r: (plan.procs[r].role != "worker", r))
        others = sorted({node[r] for r, lost in views.items() if any(node[x] == cut for x in lost)} - {cut})
        return rank, (f"{node_name(cut)} was unreachable (a network partition): {_nodes(others)} lost contact "
                      f"with its processes, and they with the rest of the job")
    first = min(doubted, key=doubted.get)
    return first if final or now - doubted[first] > LISTEN_S else None


def cut_node(accused: dict[int, set[int]], chief: int) -> int | None:
    """The node cut off, from each node's view (node -> the nodes it lost contact with), or None when no
    two nodes lost each other (then no partition: a frozen or dead process). The node most others lost;
    between as many, not the chief's."""
    votes: dict[int, set[int]] = {}
    for by, lost in accused.items():
        for n in lost - {by}:
            votes.setdefault(n, set()).add(by)
    if not any(n in votes.get(by, ()) for n, bys in votes.items() for by in bys):
        return None
    return max(votes, key=lambda n: (len(votes[n]), n != chief, -n))


def _nodes(nodes: list[int]) -> str:
    names = [str(n + 1) for n in nodes]
    return f"node {names[0]}" if len(names) == 1 else f"nodes {', '.join(names[:-1])} and {names[-1]}"


def write_failure(run_dir: Path, plan: Plan, rank: int, what: str, host: str | None = None) -> None:
    """RUN_DIR/logs/failure.json: the process that failed first, for run.py's line and restart."""
    p = plan.procs[rank]
    try:
        (run_dir / "logs" / "failure.json").write_text(json.dumps(
            {"rank": rank, "role": p.role, "node": p.node, "host": host, "what": what}) + "\n")
    except OSError as e:  # a full disk: the failure is still reported, only not recorded for a restart
        print(f"scaletrain: warning: could not record the failure in {run_dir / 'logs' / 'failure.json'}: "
              f"{e.strerror or e}", file=sys.stderr)


def _stop(procs: list[Forked], sig: int) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(sig)
