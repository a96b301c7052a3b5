"""Start-up of a job's process groups with real processes over gloo (comm/groups.py): every group runs a
collective before training, so a group that cannot work fails at start-up naming it, and the
workers agree on the device before any NCCL group is made."""
import datetime
import multiprocessing as mp
import os
import signal
import socket

import pytest
import torch
import torch.distributed as dist

from scaletrain.config import ClusterConfig
from scaletrain.plan import make_plan

TIMEOUT = datetime.timedelta(seconds=20)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join(rank, port):
    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=TIMEOUT)


def broken_peer(rank, port, out):
    """Rank 1 dies (as a process killed at start-up would) after making the group, before its collective."""
    from scaletrain.comm import end, groups

    join(rank, port)
    plan = make_plan(ClusterConfig(nodes=1, gpus_per_node=2), ps_required=False)
    g = dist.new_group([0, 1], timeout=TIMEOUT)
    if rank == 1:
        os._exit(0)
    try:
        groups.check_groups([("the replicas of node 1", [0, 1], g)], plan.procs[rank], TIMEOUT)
        out.put("no error")
    except groups.PeerLost as e:
        out.put(str(e))


def disagreeing(rank, port, out):
    """Rank 1 found GPUs where rank 0 found none: each built its plan from its own host's facts."""
    from scaletrain.comm import end, groups

    join(rank, port)
    plan = make_plan(ClusterConfig(nodes=2, gpus_per_node=1), ps_required=False, gpus=rank)
    try:
        groups.agree_on_devices(plan, rank)
        out.put("agreed")
    except Exception as e:  # noqa: BLE001
        out.put(f"{type(e).__name__}: {e}")


def busy_at_start_up(rank, port, out):
    """A job of two (timeout_s = 2) whose rank 1, once joined, holds the GIL for 9 s: work of C code
    that never lets its heartbeat thread run (parsing a large data index, say)."""
    import ctypes

    from scaletrain.comm import end, groups

    ctx = join_job(rank, port)
    if rank == 1:
        ctypes.PyDLL(None).sleep(9)  # a PyDLL call keeps the GIL: no Python thread of this process runs
    end.finish(ctx)
    out.put(f"rank {rank} finished")


def join_job(rank, port):
    """groups.init of a job of two (timeout_s = 2), as the local launcher's processes call it."""
    from scaletrain.comm import end, groups
    from scaletrain.config import Config
    from scaletrain.proc.env import rendezvous

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cfg = Config().replace(**{"cluster.nodes": 2, "cluster.timeout_s": 2.0})
    plan = make_plan(cfg.cluster, ps_required=False)
    return groups.init(cfg, plan, rendezvous(plan, "127.0.0.1", port))


def stopped_before_joining(rank, port, out):
    """Rank 1 is stopped (SIGSTOP) before it reaches the rendezvous."""
    from scaletrain.comm import end, groups

    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    try:
        join_job(rank, port)
        out.put("joined")
    except groups.PeerLost as e:
        out.put((str(e), e.culprits))


def run(target, timeout=60, stopped=()):
    """Run `target` in two processes; those in `stopped` stopped themselves: killed once the others ended."""
    ctx, port = mp.get_context("spawn"), free_port()
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    for r, p in enumerate(procs):
        if r not in stopped:
            p.join(timeout)
            assert p.exitcode is not None, "a process hung"
    for r in stopped:
        procs[r].kill()
        procs[r].join()
    return [out.get(timeout=5) for _ in range(out.qsize())]


def test_a_group_that_cannot_run_a_collective_fails_at_start_up_naming_it():
    (msg,) = run(broken_peer)
    assert msg.startswith("the replicas of node 1 (ranks 0-1) could not run a collective over gloo"), msg
    assert "cluster.ifname" in msg and "\n" not in msg


def test_workers_that_disagree_on_the_device_fail_naming_both():
    msgs = run(disagreeing)
    assert len(msgs) == 2 and msgs[0] == msgs[1], msgs
    assert msgs[0].startswith("LaunchError: rank 0 (worker 0 on node 1) found no CUDA GPU while rank 1 (worker 1 "
                              "on node 2) found one"), msgs[0]


def test_a_rank_busy_past_the_timeout_holding_the_gil_is_not_declared_lost(capfd):
    """Liveness is not a time limit on work: the beats come from a process beside each job
    process (comm/liveness.py), which the busy one's GIL does not hold up."""
    msgs = run(busy_at_start_up)
    assert sorted(msgs) == ["rank 0 finished", "rank 1 finished"], (msgs, capfd.readouterr().err)


def test_a_process_stopped_before_the_rendezvous_is_named_at_the_start_up_timeout():
    (msg,) = run(stopped_before_joining, stopped=(1,))
    what, culprits = msg
    assert culprits == [1], msg
    assert what.startswith("no rendezvous for job local at 127.0.0.1:") and \
        what.endswith(": rank 1 (worker 1 on node 2) did not join within 2 s (frozen, dead, or never started)"), what
