"""The ring that re-forms without a lost member (comm/ring.py), on three real processes over gloo.

The chief's declaration (liveness.py) is played by the test's processes themselves: once member 2
has left, each survivor's `ctx.dropped` names it, as its heartbeat thread would once the chief
declared it. What is checked is the ring's own part: its collectives go on among the survivors,
and a member that was one collective behind takes the front's state, bit for bit, instead of
redoing its own.
"""

import hashlib
import json
import subprocess
import sys
import textwrap

import torch

from conftest import ROOT, free_port

MEMBER = textwrap.dedent("""
    import datetime, json, os, sys, threading, time, types
    import torch, torch.distributed as dist
    from scaletrain.comm.groups import Context
    from scaletrain.comm.ring import Finished, Ring
    from scaletrain.config import ClusterConfig
    from scaletrain.plan import make_plan

    rank, port, how = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 3, rank == 0, datetime.timedelta(seconds=30))
    if rank == 0:  # the job's view as liveness.join starts it
        store.set("lost", "")
        store.set("admits", "0")
    plan = make_plan(ClusterConfig(nodes=3), ps_required=False)
    ctx = Context(plan, plan.procs[rank], 5.0, store=store)
    weights = torch.full((1000,), float(rank))  # what a member holds: a front member's goes to those behind
    ring = Ring(ctx, lambda: {"w": weights.clone()}, lambda s: weights.copy_(s["w"]))

    def declare():  # the chief's word, once member 2 is gone (liveness._declare: its list, then the store's)
        own = store.clone()
        while not own.check(["gone/2"]):
            time.sleep(0.05)
        time.sleep(0.5)
        ctx.dropped = [2]
        if rank == 0:
            own.set("lost", "2")

    threading.Thread(target=declare, daemon=True).start()
    out = {}
    for i in range(3):
        t = torch.ones(10)
        assert ring.allreduce(t) and t[0] == 3
    if rank == 2:
        store.set("gone/2", "1")
        os._exit(9) if how == "kill" else os.kill(os.getpid(), 19)
    if rank == 0 and how == "behind":  # as if its 4th collective ended here and not at member 1: it stepped
        weights.add_(100)
        ring.done += 1
        ring.last = torch.tensor([7.0])
    if rank == 0 and how == "finished":  # the front ended the job (end.finish marks it done); it serves the store
        store.set("done/0", "1")
        time.sleep(5)
        print(json.dumps(out), flush=True)
        os._exit(0)
    t = torch.tensor([float(rank + 1), 0.0])
    try:
        out["applied"] = ring.allreduce(t, small=1)
    except Finished:  # ended here, as the job's last step would
        out["finished"] = True
        out["applied"] = True
    out["result"] = t.tolist()
    if rank == 1 and not out["applied"]:  # behind: the front is at its 5th collective; so is this one now
        t = torch.tensor([float(rank + 1), 0.0])
        out["then"] = (ring.allreduce(t, small=1), t.tolist())
    out.update(weights=weights.tolist()[:3], members=ring.members, done=ring.done, losses=len(ring.losses))
    print(json.dumps(out), flush=True)
    os._exit(0)  # member 2 may still be stopped: no group's destructor waits for it
""")


def run_ring(tmp_path, how):
    port = free_port()
    script = tmp_path / "member.py"
    script.write_text(MEMBER)
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(port), how], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(3)]
    try:
        outs = [p.communicate(timeout=60) for p in procs[:2]]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err
    return [json.loads(o.strip().splitlines()[-1]) for o, _ in outs]


def test_the_survivors_of_a_killed_member_go_on_in_a_ring_of_two(tmp_path):
    a, b = run_ring(tmp_path, "kill")
    for got in (a, b):
        # Redone among the two: 1 + 2, each member's own state kept
        assert got["applied"] and got["result"] == [3.0, 0.0] and got["members"] == [0, 1], got
        assert got["done"] == 4 and got["losses"] == 1
    assert a["weights"] == [0.0] * 3 and b["weights"] == [1.0] * 3


def test_the_survivors_of_a_frozen_member_leave_it_waiting(tmp_path):
    for got in run_ring(tmp_path, "stop"):
        assert got["applied"] and got["result"] == [3.0, 0.0] and got["members"] == [0, 1], got


def test_a_member_behind_takes_the_fronts_state_bit_for_bit(tmp_path):
    front, behind = run_ring(tmp_path, "behind")
    # The front redid its 5th collective in the new ring; the one behind took its state and its 4th's
    # small result, then met it there
    assert front["applied"] and front["result"] == [3.0, 0.0], front
    assert not behind["applied"] and behind["result"] == [2.0, 7.0], behind
    assert behind["then"] == [True, [3.0, 0.0]], behind
    assert behind["weights"] == front["weights"] == [100.0] * 3
    assert front["done"] == behind["done"] == 5


def test_a_member_behind_a_front_that_ended_the_job_ends_too(tmp_path):
    front, behind = run_ring(tmp_path, "finished")
    # Member 2 was killed, the chief's word came, and the new ring would wait for member 0 for ever
    assert behind["finished"] and behind["weights"] == [1.0] * 3 and behind["done"] == 3, behind


REPLICA = textwrap.dedent("""
    import datetime, hashlib, json, math, os, sys, threading, time
    import torch, torch.distributed as dist
    from scaletrain.comm.groups import Context
    from scaletrain.comm.liveness import _read_joins
    from scaletrain.comm.ring import Ring
    from scaletrain.config import ClusterConfig
    from scaletrain.plan import make_plan

    rank, port, late = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "late"
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 3, rank == 0 and not late, datetime.timedelta(seconds=30))
    if rank == 0 and not late:  # the job's view as liveness.join starts it
        store.set("lost", "")
        store.set("admits", "0")
    plan = make_plan(ClusterConfig(nodes=3), ps_required=False)
    ctx = Context(plan, plan.procs[rank], 5.0, store=store, late=late, member_since=math.inf if late else 0.0)
    # One seed for the replicas, another for the replacement: what it holds once it joined is what it took
    weights = torch.randn(4096, generator=torch.Generator().manual_seed(99 if late else 0))
    moment = torch.zeros(4096)  # an optimizer's state, which comes with the weights

    def state():
        return {"w": weights.clone(), "m": moment.clone()}

    def adopt(s):
        weights.copy_(s["w"])
        moment.copy_(s["m"])

    def chief():  # the chief's heartbeat thread: the word on member 2, then the replacement's request to join
        own = store.clone()
        while not own.check(["gone/2"]):
            time.sleep(0.05)
        time.sleep(0.5)
        ctx.dropped = [2]
        if rank == 0:
            own.set("lost", "2")
            while ctx.dropped:
                _read_joins(ctx, own)
                time.sleep(0.1)
        else:
            while own.get("admits") != b"1":  # liveness._read_dropped: the store's `lost` a beat later
                time.sleep(0.1)
            ctx.dropped = []

    if not late:
        threading.Thread(target=chief, daemon=True).start()
    ring = Ring(ctx, state, adopt)
    taken = hashlib.sha256(weights.numpy().tobytes()).hexdigest() if late else None
    joined_at = ring.done if late else None
    steps = 0
    while joined_at is None or ring.done < joined_at + 10:
        if rank == 2 and not late and steps == 3:
            store.set("gone/2", "1")
            os._exit(9)
        g = torch.sin(weights * (ring.done + 1))  # a gradient of the weights held
        before = ring.done
        ring.boundary()  # as AllReduce._ring_step: a replacement the last collective admitted joins here
        ring.allreduce(g)
        moment.mul_(0.9).add_(g / ring.size)
        weights.sub_(0.01 * moment)
        steps += 1
        if joined_at is None and ring.view[0] == 1:
            joined_at = before
        time.sleep(0.05)
    print(json.dumps({"sha": hashlib.sha256(weights.numpy().tobytes()).hexdigest(), "done": ring.done,
                      "joined_at": joined_at, "members": ring.members, "taken": taken, "healed": ring.healed_s,
                      "joins": [{k: v for k, v in j.items() if k != "t"} for j in ring.joins]}), flush=True)
    os._exit(0)
""")


def test_a_replacement_takes_a_live_replicas_state_and_stays_equal_to_it_bit_for_bit(tmp_path):
    """Member 2 is killed; the two go on; a replacement asks to join, the chief admits it at its next
    collective and sends it its weights and optimizer state; from then on the three step alike."""
    port = free_port()
    script = tmp_path / "replica.py"
    script.write_text(REPLICA)
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(port), "member"], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(3)]
    try:
        procs[2].wait(timeout=60)
        procs.append(subprocess.Popen([sys.executable, str(script), "2", str(port), "late"], cwd=ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        outs = [p.communicate(timeout=90) for p in (procs[0], procs[1], procs[3])]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    for p, (_, err) in zip((procs[0], procs[1], procs[3]), outs):
        assert p.returncode == 0, err
    chief, other, new = [json.loads(o.strip().splitlines()[-1]) for o, _ in outs]
    assert chief["members"] == other["members"] == new["members"] == [0, 1, 2], (chief, other, new)
    assert chief["joined_at"] == other["joined_at"] == new["joined_at"] > 3, (chief, other, new)
    assert chief["done"] == other["done"] == new["done"] == new["joined_at"] + 10
    assert chief["sha"] == other["sha"] == new["sha"], (chief, other, new)  # ten steps on, bit for bit alike
    assert new["taken"] != hashlib.sha256(torch.randn(  # it holds what it took, not its own seed's
        4096, generator=torch.Generator().manual_seed(99)).numpy().tobytes()).hexdigest()
    (j,) = chief["joins"]
    assert j["ranks"] == [2] and j["pause_s"] < 5, j
    assert new["healed"]["wait_s"] > 0 and new["healed"]["adopt_s"] < 5, new
