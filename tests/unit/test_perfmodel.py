"""The performance model: closed forms, the simulation on cases with a known answer,
the recommender on a toy profile, the study's profile against the study's figures,
and calibrate -> bench -> validate -> report on this machine."""

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from scaletrain.config import load_config
from scaletrain.perfmodel import costs
from scaletrain.perfmodel.predict import estimate, predict
from scaletrain.perfmodel.profile import Profile, ProfileError, at_batch, dump_profile, largest_batch, load_profile
from scaletrain.perfmodel.recommend import batch_candidates, recommend
from scaletrain.perfmodel.setup import ModelError, check_workload, make_setup
from scaletrain.perfmodel.simulate import simulate

ROOT = Path(__file__).resolve().parents[2]
G = 1_000_000  # bytes of the toy gradient
TOY = Profile(model="resnet8", image_size=16, batch_per_replica=32, gradient_bytes=G, replicas_per_node=4,
              compute_s=1.0, optimizer_s=0.01, intra_bandwidth=1e7, intra_latency=1e-3, net_bandwidth=1e6,
              net_latency=0.01, local_bandwidth=1e8, ps_apply_rate=1e8)


def cfg_of(strategy="allreduce", nodes=1, gpus=1, ps=0, where="alongside", **more):
    sets = [f"strategy.name={strategy}", f"cluster.nodes={nodes}", f"cluster.gpus_per_node={gpus}",
            f"cluster.num_ps={ps}", f"cluster.ps_placement={where}", "model.name=resnet8", "data.image_size=16"]
    return load_config(None, sets + [f"{k.replace('__', '.')}={v}" for k, v in more.items()])


# --- closed forms -----------------------------------------------------------------------------

def test_ring_allreduce_alpha_beta():
    # 2(n-1) steps, each latency + (bytes/n)/bandwidth
    assert costs.ring_allreduce_s(4, 100, bandwidth=10, latency=1) == pytest.approx(6 * (1 + 2.5))
    assert costs.ring_allreduce_s(1, 100, 10, 1) == 0
    # large messages: each process moves 2(n-1)/n of the buffer, tending to 2x
    assert costs.ring_allreduce_s(64, 1e9, 1e9, 0) == pytest.approx(2 * 63 / 64)


def test_broadcast():
    assert costs.broadcast_s(4, 100, 10, 1) == pytest.approx(2 * 1 + 10)
    assert costs.broadcast_s(1, 100, 10, 1) == 0


def test_allreduce_step_uses_network_ring_across_nodes():
    est = costs.allreduce(TOY, make_setup(cfg_of(nodes=2, gpus=2), TOY))
    ring = 2 * 3 * (0.01 + G / 4 / 1e6)
    assert est.step_s == pytest.approx(1.0 + ring + 0.01)
    assert est.images_per_step == 4 * 32
    one = costs.allreduce(TOY, make_setup(cfg_of(nodes=1, gpus=4), TOY))  # inside the node: intra figures
    assert one.step_s == pytest.approx(1.0 + 2 * 3 * (1e-3 + G / 4 / 1e7) + 0.01)


def test_async_allreduce_steps_at_compute_and_rounds_last_whole_steps():
    # 2 nodes x 2 replicas; the network ring takes 6 x (0.01 + 0.25) = 1.56 s, a replica's step 1.0 s
    # of compute and 0.01 s adding its gradient (accumulate rate 1e8): a round lasts 2 steps.
    toy = replace(TOY, ps_accumulate_rate=1e8)
    st = make_setup(cfg_of("async-allreduce", nodes=2, gpus=2), toy)
    est = costs.async_allreduce(toy, st)
    assert est.step_s == pytest.approx(1.0 + 0.01 + 0.01 / 2)  # the optimizer once a round
    assert est.gradients_per_update == 2 * 4 and est.staleness_mean == 1.0
    assert est.images_per_sec > costs.allreduce(toy, st).images_per_sec  # no replica waits for the ring
    fast = replace(toy, net_bandwidth=1e12, net_latency=0.0)  # instant rings: one gradient per replica
    est = costs.async_allreduce(fast, st)
    assert est.gradients_per_update == 4 and est.step_s == pytest.approx(1.0 + 0.01 + 0.01)
    slowed = make_setup(cfg_of("async-allreduce", nodes=2, gpus=2, strategy__slow_node=1,
                               strategy__slow_delay_s=1.02), fast)
    # node 2 steps twice as slowly: it adds half the gradients, and holds no one back
    assert costs.async_allreduce(fast, slowed).images_per_sec == pytest.approx(
        0.75 * est.images_per_sec)
    row = predict(cfg_of("async-allreduce", nodes=2, gpus=2), toy)
    # The simulation plays the same steps out: with equal speeds it agrees with the closed form.
    assert row["gradients_per_update"] == pytest.approx(8, rel=0.02) and row["method"] == "simulation"
    assert row["images_per_sec"] == pytest.approx(costs.async_allreduce(toy, st).images_per_sec, rel=0.02)
    assert row["staleness_p95"] == 1.0 and row["staleness_mean"] == pytest.approx(1.0, abs=0.02)
    cfg = cfg_of("async-allreduce", nodes=2, gpus=2, strategy__slow_node=1, strategy__slow_delay_s=1.02)
    assert predict(cfg, fast)["images_per_sec"] == pytest.approx(0.75 * est.images_per_sec, rel=0.03)
    # Uneven speeds: a round starts when the last replica ends a step, so rounds carry more gradients.
    assert predict(cfg_of("async-allreduce", nodes=2, gpus=2), toy, spread=0.3)["gradients_per_update"] > 8.5
    one = predict(cfg_of("async-allreduce", nodes=1, gpus=1), toy)
    assert one["staleness_mean"] == 0.0 and one["gradients_per_update"] == 1.0


def test_sync_ps_accumulates_every_gradient_and_applies_once():
    # Three pushers, one dedicated one-thread shard, transfers near free: a round is compute,
    # three gradients added into the accumulator and one update (the sum's mean, one more pass,
    # then the optimizer), where a shard applying every gradient would take three updates.
    free = replace(TOY, net_bandwidth=1e15, local_bandwidth=1e15, net_latency=0.0, ps_accumulate_rate=1e7,
                   ps_apply_rate=1e6)
    st = make_setup(cfg_of("sync", nodes=3, ps=1, where="dedicated"), free)
    round_s = 1.0 + 3 * G / 1e7 + (G / 1e7 + G / 1e6)
    assert costs.sync_ps(free, st).step_s == pytest.approx(round_s, rel=1e-6)
    assert simulate(free, st, cycle_hint=round_s).step_s == pytest.approx(round_s, rel=1e-3)
    # asynchronous shards apply every gradient: with these figures the shard is the bottleneck
    # at one update per second, three rounds' worth of pushers sharing it
    res = simulate(free, make_setup(cfg_of("mixed-async", nodes=3, ps=1, where="dedicated"), free),
                   cycle_hint=round_s)
    assert res.images_per_sec == pytest.approx(32 / (G / 1e6), rel=0.02)


def test_scaletrain_shard_receives_once_free_while_it_works_and_replies_in_turn():
    # N pushers into one dedicated shard, each transfer t = G / 1e6 + latency. The shard replies to
    # each in turn (at t, 2t, ..., Nt after its update); pusher i computes c after its reply; the
    # shard asks for its gradient once the replies are out, and the gradients come in through the
    # PS's link, one after another in this formula (the simulation lets two that overlap share the
    # link: 0.3% on the round at c = 1); the shard adds each (a), then updates (u).
    n, t = 3, G / 1e6 + 0.01
    for c in (1.0, 5.0):
        p = replace(TOY, compute_s=c)
        st = make_setup(cfg_of("sync", nodes=n, ps=1, where="dedicated"), p)
        a, u = G / p.ps_accumulate_rate, G / p.ps_accumulate_rate + G / p.ps_apply_rate
        arrived, link = [], 0.0
        for i in range(1, n + 1):
            link = max(i * t + c, n * t, link) + t
            arrived.append(link)
        free = n * t
        for x in arrived:
            free = max(free, x) + a
        round_s = free + u
        if c == 5.0:  # every reply is out long before the first gradient is back: c + (N + 1) t + a + u
            assert round_s == pytest.approx(c + (n + 1) * t + a + u)
        assert costs.sync_ps(p, st).step_s == pytest.approx(round_s, rel=1e-6)
        assert simulate(p, st, cycle_hint=round_s).step_s == pytest.approx(round_s, rel=0.005)
        assert costs.sync_ps(p, st).link_bytes == {"node 1": G, "node 2": G, "node 3": G, "node 4": n * G}


def test_transfers_on_a_link_share_it_as_tcp_flows_do():
    """Three transfers into one node at once all end at 3 t; one that starts while another is under way
    halves its rate until either ends (a link of 1 MB/s, transfers of 1 MB: t = 1 s)."""
    import simpy
    from scaletrain.perfmodel.simulate import _Links
    env = simpy.Environment()
    links, ends = _Links(env, 1e6), {}

    def send(name, src, dst, start):
        yield env.timeout(start)
        yield links.send(((src, "out"), (dst, "in")), 1e6)
        ends[name] = env.now

    for k in range(3):
        env.process(send(f"in{k}", k, 9, 0.0))
    env.process(send("first", 4, 5, 10.0))
    env.process(send("second", 6, 5, 10.5))  # shares node 5's incoming link from 10.5 s on
    env.run()
    assert ends == pytest.approx({"in0": 3.0, "in1": 3.0, "in2": 3.0, "first": 11.5, "second": 12.0})
    assert links.busy[9, "in"] == pytest.approx(3.0) and links.busy[5, "in"] == pytest.approx(2.0)


def test_transfers_end_far_into_a_simulation_where_the_clock_is_coarse():
    """At 3e7 s a step of the float clock is about 4 ns: transfers that end within it still end."""
    import random

    import simpy
    from scaletrain.perfmodel.simulate import _Links
    rng = random.Random(0)
    for _ in range(20):
        env = simpy.Environment(initial_time=3e7)
        links, ends = _Links(env, 1e3), []

        def send(src, nbytes):
            yield env.timeout(rng.random())
            yield links.send(((src, "out"), (9, "in")), nbytes)
            ends.append(env.now)

        for k in range(3):
            env.process(send(k, rng.uniform(1e3, 1e4)))
        env.run(until=3e7 + 1e3)
        assert len(ends) == 3


def test_threaded_shard_overlaps_transfers_with_its_work():
    # A threaded shard (ps_overlap): all N gradients come in through the PS's link at once, the
    # adds hide behind them but for one, then the update (the mean, G / 1e10, and the optimizer,
    # G / 1e8); the replies go out at once.
    n = 3
    p = replace(TOY, ps_overlap=True)
    st = make_setup(cfg_of("sync", nodes=n, ps=1, where="dedicated"), p)
    est = costs.sync_ps(p, st)
    assert est.step_s == pytest.approx(1.0 + 2 * (n * G / 1e6 + 0.01) + G / 1e10 + (G / 1e10 + G / 1e8))
    # Played out in time, the N gradients share the PS's link as TCP flows do, so all come in after
    # N t, and so do the replies, sent at once: a round lasts c + 2 N t + the N adds and the update
    # + two latencies, not c + (N + 1) t as with transfers one after another. (The closed form hides
    # all adds but one behind the transfers: here an add is 1e-4 s.)
    res = simulate(p, st, cycle_hint=5.0)
    assert res.step_s == pytest.approx(1.0 + 2 * n * G / 1e6 + n * G / 1e10 + (G / 1e10 + G / 1e8) + 2 * 0.01,
                                       rel=0.005)


def test_sync_is_as_fast_as_mixed_async_with_equal_speeds_and_a_cheap_network():
    # The study saw synchronous throughput as high as asynchronous up to 16 nodes: a sync shard
    # adds N gradients and applies once, an async one applies N times; with the network out of
    # the way the two keep the GPUs equally busy.
    k80, _ = load_profile(ROOT / "profiles/study-k80.toml")
    cheap = replace(k80, net_bandwidth=100 * k80.net_bandwidth, local_bandwidth=100 * k80.net_bandwidth)
    for nodes, ps in ((2, 1), (4, 3), (8, 7), (16, 7)):
        rows = [predict(load_config(ROOT / "recipes/anp-resnet50.toml", [
            f"strategy.name={s}", "cluster.gpus_per_node=4", f"cluster.nodes={nodes}", f"cluster.num_ps={ps}"]), cheap)
            for s in ("sync", "mixed-async")]
        assert rows[0]["images_per_sec"] == pytest.approx(rows[1]["images_per_sec"], rel=0.08), (nodes, ps)


def test_sync_ps_sharding_and_per_replica_pushes():
    # More dedicated shards split the hot link's bytes.
    one = costs.sync_ps(TOY, make_setup(cfg_of("sync", nodes=2, ps=1, where="dedicated"), TOY))
    two = costs.sync_ps(TOY, make_setup(cfg_of("sync", nodes=2, ps=2, where="dedicated"), TOY))
    assert two.step_s < one.step_s
    # Colocated: the node's own pusher reaches its PS without the network.
    along = make_setup(cfg_of("sync", nodes=2, ps=1), TOY)
    assert costs.sync_ps(TOY, along).link_bytes == {"node 1": G, "node 2": G}
    # Pushing per replica (async) sends gpus times the bytes of pushing per node.
    per_node = make_setup(cfg_of("mixed-async", nodes=2, gpus=2, ps=1, where="dedicated"), TOY)
    per_replica = make_setup(cfg_of("async", nodes=2, gpus=2, ps=1, where="dedicated"), TOY)
    assert per_replica.pushers == 2 * per_node.pushers
    assert sum(costs._phase_bytes(per_replica)[1].values()) == 2 * sum(costs._phase_bytes(per_node)[1].values())


# --- the simulation ---------------------------------------------------------------------------

@pytest.mark.parametrize("n", [2, 4, 8])
def test_equal_async_workers_are_n_minus_1_stale(n):
    fast = replace(TOY, net_bandwidth=1e9, ps_apply_rate=1e10)
    res = simulate(fast, make_setup(cfg_of("async", nodes=n, ps=1), fast), cycle_hint=1.0)
    assert res.staleness_mean == pytest.approx(n - 1, abs=0.05)
    # the PS takes 1e-4 s a gradient: no queue, every cycle is compute + two transfers + take-in,
    # except the PS's own node's, whose transfers are local
    remote, local = 1.0 + 2 * (0.01 + G / 1e9) + G / 1e10, 1.0 + 2 * G / 1e8 + G / 1e10
    assert res.images_per_sec == pytest.approx(32 * ((n - 1) / remote + 1 / local), rel=0.01)


def test_backup_with_no_backups_is_sync():
    for shape in [dict(nodes=3, ps=1, where="dedicated"), dict(nodes=4, ps=2), dict(nodes=2, gpus=2, ps=1)]:
        sync = make_setup(cfg_of("sync", **shape), TOY)
        backup = make_setup(cfg_of("backup", **shape, strategy__backup_workers=0), TOY)
        assert backup == sync and backup.wait_for == backup.pushers
        closed = costs.sync_ps(TOY, sync)
        a = simulate(TOY, backup, cycle_hint=closed.step_s)
        b = simulate(TOY, sync, cycle_hint=closed.step_s)
        assert a.images_per_sec == b.images_per_sec and a.dropped_fraction == 0 and a.staleness_mean == 0
    for shape in [dict(nodes=3, ps=1, where="dedicated"), dict(nodes=2, gpus=2, ps=1)]:  # one shard: the two agree
        st = make_setup(cfg_of("backup", **shape, strategy__backup_workers=0), TOY)
        closed = costs.sync_ps(TOY, st)
        assert simulate(TOY, st, cycle_hint=closed.step_s).step_s == pytest.approx(closed.step_s, rel=0.01)


def test_backup_workers_leave_the_straggler_behind():
    slow = dict(strategy__slow_node=2, strategy__slow_delay_s=3.0)
    fast = replace(TOY, net_bandwidth=1e8)
    sync, _ = estimate(fast, make_setup(cfg_of("sync", nodes=4, ps=1, where="dedicated", **slow), fast))
    backup, _ = estimate(fast, make_setup(cfg_of("backup", nodes=4, ps=1, where="dedicated",
                                                 strategy__backup_workers=1, **slow), fast))
    assert backup.images_per_sec > 1.5 * sync.images_per_sec
    assert 0 < backup.dropped_fraction <= 0.25
    assert sync.straggler_s == pytest.approx(3.0, rel=0.05)  # everyone waits the slow node's delay


def test_speed_spread_slows_sync_more_than_async():
    fast = replace(TOY, net_bandwidth=1e9, ps_apply_rate=1e10)
    for name, lo, hi in (("sync", 0.6, 0.9), ("mixed-async", 0.97, 1.03)):
        st = make_setup(cfg_of(name, nodes=8, ps=1), fast)
        even, _ = estimate(fast, st)
        uneven, _ = estimate(fast, st, spread=0.3)
        assert lo < uneven.images_per_sec / even.images_per_sec < hi, name


# --- the input pipeline ------------------------------------------------------------------------

@pytest.mark.parametrize("strategy,ps", [("allreduce", 0), ("sync", 1), ("mixed-async", 1)])
def test_slow_loaders_bound_the_throughput(strategy, ps):
    # 2 loaders a replica at 2 img/s each need 8 s per 32-image batch, far over the ~3 s of
    # compute and communication: every replica runs at its loaders' pace, communication included.
    slow = replace(TOY, input_rate=2.0)
    row = predict(cfg_of(strategy, nodes=2, gpus=2, ps=ps, data__workers=2), slow)
    assert row["bottleneck"] == "input" and row["parts_s"]["input"] == pytest.approx(8.0)
    assert row["images_per_sec"] == pytest.approx(4 * 2.0 * 2, rel=0.01)
    assert row["parts_s"]["compute"] == TOY.compute_s


def test_loading_in_the_training_process_is_in_series_with_compute():
    prof = replace(TOY, input_rate=16.0, optimizer_s=0.0)  # 2 s of loading a 32-image batch
    row = predict(cfg_of(data__workers=0), prof)
    assert row["images_per_sec"] == pytest.approx(32 / (1.0 + 32 / 16.0))
    assert row["bottleneck"] == "input" and row["busy"]["input"] == pytest.approx(2 / 3)
    # the same core's work in a background loader (2 of them) overlaps compute instead
    assert predict(cfg_of(data__workers=2), prof)["images_per_sec"] == pytest.approx(32 / 1.0)


def test_input_rate_0_changes_nothing(tmp_path):
    without, zero = tmp_path / "without.toml", tmp_path / "zero.toml"
    text = dump_profile(TOY, {})
    without.write_text(text.replace("[input]\ninput_rate = 0.0\nread_rate = 0.0\n", ""))
    zero.write_text(text)
    assert "[input]" not in without.read_text() and load_profile(without)[0] == load_profile(zero)[0] == TOY
    for cfg in (cfg_of(data__workers=0), cfg_of("sync", nodes=2, ps=1), cfg_of("mixed-async", nodes=2, ps=1)):
        a, b = predict(cfg, load_profile(without)[0]), predict(cfg, load_profile(zero)[0])
        assert a == b and "input" not in a["parts_s"] and "input" not in a["busy"]
    # and a profile carries its rate through dump and load
    (tmp_path / "rate.toml").write_text(dump_profile(replace(TOY, input_rate=150.0), {}))
    assert load_profile(tmp_path / "rate.toml")[0].input_rate == 150.0


# --- predictions, the study's profile, the recommender -----------------------------------------

# The study's 4-worker rows (shared reference): placement, measured img/s, and whether the profile
# was set from the row (profiles/study-k80.toml: compute_s from the 1-node row, net_bandwidth from
# the dedicated-PS row, ps_apply_rate from the 1-PS row). A fitted row can only show that the fit
# holds; the held-out row is the prediction.
STUDY = [
    ("cluster.num_ps=0", "cluster.nodes=1", 124.18, "fitted"),
    ("cluster.num_ps=3", "cluster.ps_placement=dedicated", 396.62, "fitted"),
    ("cluster.num_ps=1", "cluster.ps_placement=alongside", 292.22, "fitted"),
    ("cluster.num_ps=3", "cluster.ps_placement=alongside", 374.73, "held out"),
]


def study_row(ps: str, where: str) -> dict:
    prof, _ = load_profile(ROOT / "profiles/study-k80.toml")
    sets = ["cluster.gpus_per_node=4", "cluster.nodes=4", ps, where,
            "strategy.name=" + ("allreduce" if ps.endswith("=0") else "mixed-async")]
    return predict(load_config(ROOT / "recipes/anp-resnet50.toml", sets), prof)


@pytest.mark.parametrize("ps,where,measured,role", STUDY)
def test_study_profile_reproduces_its_fit_and_predicts_the_held_out_row(ps, where, measured, role):
    row = study_row(ps, where)
    # 0.5%: the profile's fitted figures are rounded to 2-3 digits; 5% for the prediction (-2.5%),
    # where a PS alongside costing nothing (the dedicated row, 396.9 img/s) would be +5.9%.
    assert row["images_per_sec"] == pytest.approx(measured, rel=0.005 if role == "fitted" else 0.05)
    assert row["efficiency"] == pytest.approx(row["speedup"] / row["nodes_total"])


def test_one_ps_for_four_nodes_is_ps_bound():
    prof, _ = load_profile(ROOT / "profiles/study-k80.toml")
    cfg = load_config(ROOT / "recipes/anp-resnet50.toml", ["cluster.gpus_per_node=4", "cluster.nodes=4",
                                                           "cluster.num_ps=1", "strategy.name=mixed-async"])
    row = predict(cfg, prof)
    assert row["bottleneck"] == "PS CPU" and row["ps_cpu_util"] > 0.95
    assert row["staleness_mean"] == pytest.approx(3.0, abs=0.1)


def test_recommender_on_a_toy_profile_with_a_known_best():
    # A latency-bound network (1 s a message), everything else free, compute 1 s:
    # - all-reduce across n nodes pays 2(n-1) latencies a step, a PS push two (3 s cycles);
    # - sync waits for the slowest pusher: every node at 3 s;
    # - with one PS alongside, asynchronous shards let the PS's own node (local transfers)
    #   cycle every 1 s: 32 (k / 3 + 1) img/s with k other nodes; more PS only add latency
    #   to that node, dedicated ones take a worker's place.
    # The shards are threaded: a one-thread shard would spend the latencies of every message.
    toy = replace(TOY, net_latency=1.0, net_bandwidth=1e12, intra_bandwidth=1e12, local_bandwidth=1e12,
                  ps_apply_rate=1e12, ps_accumulate_rate=1e12, ps_overlap=True, optimizer_s=0.0)
    entries = recommend(cfg_of(), toy, max_nodes=4, progress=False)
    best = {e["nodes"]: e["best"] for e in entries}
    assert [e["nodes"] for e in entries] == [1, 2, 4]
    assert best[1]["strategy"] == "allreduce" and best[1]["num_ps"] == 0  # ties go to no PS
    for n in (2, 4):
        b = best[n]
        assert (b["strategy"], b["num_ps"], b["ps_placement"], b["nodes"]) == ("mixed-async", 1, "alongside", n)
        assert b["images_per_sec"] == pytest.approx(32 * ((n - 1) / 3 + 1), rel=0.01)
    losers = {r["strategy"]: why for r, why in reversed(entries[-1]["runners_up"])}
    assert set(losers) >= {"async", "sync"} and losers["sync"].startswith("-33% throughput")
    # Asked for efficiency >= 0.9, four nodes have nothing to offer.
    assert recommend(cfg_of(), toy, 4, min_efficiency=0.9, progress=False)[-1]["best"] is None


def test_errors_name_the_file_and_key(tmp_path):
    bad = tmp_path / "p.toml"
    bad.write_text("[node]\ncompute_ms = 3\n")
    with pytest.raises(ProfileError, match=r"p.toml: unknown key node.compute_ms"):
        load_profile(bad)
    bad.write_text("[workload]\nmodel='resnet8'\ngradient_bytes=-1\n[node]\ncompute_s=1.0\n")
    with pytest.raises(ProfileError, match=r"workload.gradient_bytes = -1: out of range"):
        load_profile(bad)
    with pytest.raises(ModelError, match="measured for resnet50, 224 px; the recipe trains resnet8, 16 px"):
        check_workload(cfg_of(), load_profile(ROOT / "profiles/study-k80.toml")[0], "study-k80.toml")
    with pytest.raises(ModelError, match="offer 4 replicas"):
        make_setup(cfg_of(gpus=8), TOY)


# --- batch per replica -------------------------------------------------------------------------

GB = 1_000_000_000
MEM = dict(device_memory=8 * GB, memory_base=GB, memory_per_image=GB // 10)  # holds up to 70 images


def test_at_batch_is_the_stated_linear_form():
    p = replace(TOY, compute_base_s=0.2)  # 1.0 s at 32 images, 0.2 s of it fixed: 0.025 s an image
    assert at_batch(p, 32) is p
    for b, seconds in ((64, 1.8), (16, 0.6), (1, 0.225)):
        q = at_batch(p, b)
        assert (q.batch_per_replica, q.compute_s) == (b, pytest.approx(seconds))
        assert replace(q, batch_per_replica=32, compute_s=1.0) == p  # nothing else moves
    assert at_batch(TOY, 64).compute_s == pytest.approx(2.0)  # compute_base_s 0: proportional


def test_a_batch_that_does_not_fit_is_a_one_line_error_naming_device_memory(tmp_path):
    p = replace(TOY, **MEM)
    assert largest_batch(p) == 70 and largest_batch(TOY) is None
    assert at_batch(p, 70).batch_per_replica == 70
    with pytest.raises(ModelError, match=r"batch 71 per replica needs 8.10 GB .* > device_memory 8.00 GB") as e:
        at_batch(p, 71)
    assert "\n" not in str(e.value)
    with pytest.raises(ModelError, match="device_memory"):
        predict(cfg_of(data__batch_size=128), p)
    assert at_batch(TOY, 100_000).compute_s == pytest.approx(100_000 / 32)  # device_memory 0: no limit
    # a profile whose own batch does not fit, or whose fixed part is all of compute, does not load
    bad = tmp_path / "p.toml"
    bad.write_text(dump_profile(replace(p, batch_per_replica=71), {}))
    with pytest.raises(ProfileError, match="p.toml: batch 71 per replica needs .* device_memory"):
        load_profile(bad)
    bad.write_text(dump_profile(replace(TOY, compute_base_s=1.0), {}))
    with pytest.raises(ProfileError, match="node.compute_base_s = 1.0 must be below node.compute_s"):
        load_profile(bad)


def test_old_profiles_load_with_no_batch_scaling_and_the_new_keys_round_trip(tmp_path):
    old = tmp_path / "old.toml"
    old.write_text("[workload]\nmodel='resnet8'\ngradient_bytes=8\n[node]\ncompute_s=1.0\n")
    p = load_profile(old)[0]
    assert (p.compute_base_s, p.device_memory, p.memory_base, p.memory_per_image) == (0.0, 0, 0, 0)
    new = tmp_path / "new.toml"
    new.write_text(dump_profile(replace(TOY, compute_base_s=0.3, **MEM), {}))
    assert load_profile(new)[0] == replace(TOY, compute_base_s=0.3, **MEM)


def test_check_workload_takes_another_batch_and_predict_runs_at_it():
    p = replace(TOY, compute_base_s=0.2, optimizer_s=0.0)
    cfg = cfg_of(data__batch_size=64)
    check_workload(cfg, p, "toy.toml")  # same network and image size: accepted
    row = predict(cfg, p)
    assert row["batch_per_replica"] == 64 and row["update_batch"] == 64
    # images per update: every replica's under all-reduce, one node's under mixed-async
    assert predict(cfg_of(nodes=2, gpus=2, data__batch_size=64), p)["update_batch"] == 256
    assert predict(cfg_of("mixed-async", nodes=2, gpus=2, ps=1, data__batch_size=64), p)["update_batch"] == 128
    assert row["parts_s"]["compute"] == pytest.approx(1.8) and row["images_per_sec"] == pytest.approx(64 / 1.8)
    with pytest.raises(ModelError, match="measured for resnet8, 16 px; the recipe trains resnet8, 32 px"):
        check_workload(cfg_of(data__image_size=32), p, "toy.toml")


def test_batch_candidates():
    assert batch_candidates(32, 32, None) == [32]               # the default: the recipe's only
    assert batch_candidates(32, 256, 109) == [32, 64, 128, 256]  # unfit ones are left to the caller
    assert batch_candidates(24, 100, None) == [24, 32, 64]
    assert batch_candidates(32, 32, 20) == [16, 32]             # the recipe's does not fit: 16 does


def test_recommend_chooses_the_largest_batch_that_fits_when_batches_pay():
    # 0.9 s of each 1 s step does not grow with the batch: doubling the batch nearly doubles the
    # throughput, until 70 images a device; 128 does not fit, so 64 is the answer at every size.
    p = replace(TOY, compute_base_s=0.9, **MEM)
    entries = recommend(cfg_of(), p, max_nodes=2, progress=False, batches=[16, 32, 64, 128])
    for e in entries:
        b = e["best"]
        assert b["batch_per_replica"] == 64 and e["unfit"] == [128] and e["batches"] == [16, 32, 64]
        assert all(r["batch_per_replica"] == 64 for r, _ in e["runners_up"])
        assert "over the recipe's 32" in e["batch_reason"] and "128 needs 13.8 GB > 8.0 GB" in e["batch_reason"]
    one = entries[0]["best"]  # one replica, all-reduce with nothing to reduce: compute and optimizer only
    assert one["images_per_sec"] == pytest.approx(64 / (0.9 + 0.1 * 2 + 0.01))


def test_recommend_ties_between_batches_keep_the_recipes():
    # Compute proportional to the batch and a free network: every batch gives the same img/s;
    # the near-tie goes to the batch nearest the recipe's (32), then to the smaller.
    free = replace(TOY, net_latency=0.0, net_bandwidth=1e15, intra_bandwidth=1e15, intra_latency=0.0,
                   local_bandwidth=1e15, ps_apply_rate=1e15, optimizer_s=0.0)
    for batches, want in (([8, 16, 32, 64], 32), ([16, 64], 16), ([64, 128], 64)):
        for e in recommend(cfg_of(), free, max_nodes=2, progress=False, batches=batches):
            assert e["best"]["batch_per_replica"] == want, (batches, e["nodes"])
    e = recommend(cfg_of(), free, max_nodes=1, progress=False, batches=[32, 64])[0]
    assert e["batch_reason"] == "64 gains only +0.0%"


def test_recommend_cli_batch_options():
    base = ["predict", "--profile", "profiles/study-k80.toml", "--recipe", "recipes/anp-resnet50.toml",
            "--set", "cluster.gpus_per_node=4", "--recommend", "--max-nodes", "1"]
    r = run(*base, "--max-batch", "256")
    assert r.returncode == 0, r.stderr
    assert "batches per replica 32, 64 (128, 256 do not fit: the device holds up to 109)" in r.stderr
    assert "| allreduce, 1 node (1 worker x 4 replicas) | 64 | 256 |" in r.stdout
    r = run(*base)
    assert "batch per replica 32, the recipe's" in r.stderr and "| 32 | 128 |" in r.stdout
    r = run(*base, "--batches", "16,32", "--max-batch", "64")
    assert r.returncode == 2 and "not both" in r.stderr
    r = run(*base, "--batches", "128")
    assert r.returncode == 2 and "no batch tried fits the device" in r.stderr and "Traceback" not in r.stderr


def test_derive_charges_a_loaded_jobs_communication_to_its_bytes():
    """calibrate's jobs on a shared host: what the 2-replica job's step has beyond compute, optimizer
    and the microbenchmark's ring slows the ring's bytes, not its latency; so does the PS job's."""
    from scaletrain.perfmodel.calibrate import BIG_MIN, derive
    from scaletrain.perfmodel.setup import param_numels

    cfg = cfg_of(gpus=2)
    nbytes, big = 4 * sum(param_numels(cfg.model)), BIG_MIN
    ring_alone = 2 * 1e-4 + nbytes / 1e9  # 2 replicas: 2 (latency + bytes / (2 bandwidth))
    m = {"cpu": {"optimizer_s": 1e-3, "accumulate_s": 1e-4, "copy_s": 1e-4},
         "job1": {"step_s": 0.021}, "job1_other_batch": {"step_s": 0.011},
         "p2p": {"p2p_1": 5e-5, f"p2p_{big}": 5e-5 + 4 * big / 2e9,  # 50 us, 2 GB/s one way
                 "ar_1": 2e-4, f"ar_{big}": 2e-4 + 4 * big / 1e9},    # ring over 2: 100 us, 1 GB/s
         "job2": {"step_s": 0.020 + 1e-3 + ring_alone + 4 * nbytes / 1e9},  # the bytes 5x as slow
         "ps_job": {"step_s": 0.05}}
    host = {"device": "cpu", "gpus": 0, "cores": 2, "allreduce_over": 2, "big_elements": big, "other_batch": 16}
    p, about = derive(cfg, m, host, say=lambda *_: None)
    assert p.compute_s == pytest.approx(0.020) and p.optimizer_s == pytest.approx(1e-3)
    assert p.intra_latency == pytest.approx(1e-4) and p.intra_bandwidth == pytest.approx(1e9 / 5)
    f = about["transfer_load"]
    assert f > 1 and p.net_latency == pytest.approx(5e-5) and p.net_bandwidth == pytest.approx(2e9 / f, rel=1e-3)
    ps = predict(cfg_of("sync", nodes=2, gpus=1, ps=1), p)
    assert ps["step_s"] == pytest.approx(0.05, rel=1e-3)  # the factor makes the model's PS job the measured one
    # A PS job faster than the microbenchmark's bytes allow: the factor goes below 1, to fit it.
    fast = predict(cfg_of("sync", nodes=2, gpus=1, ps=1), replace(p, net_bandwidth=2e9 / 0.5, local_bandwidth=2e9 / 0.5))
    p, about = derive(cfg, {**m, "ps_job": {"step_s": fast["step_s"]}}, host, say=lambda *_: None)
    assert about["transfer_load"] < 0.6
    assert predict(cfg_of("sync", nodes=2, gpus=1, ps=1), p)["step_s"] == pytest.approx(fast["step_s"], rel=1e-3)


def test_calibrate_batch_line():
    from scaletrain.perfmodel.calibrate import batch_line

    # 1.0 s at 32 images, 0.6 s at 16: 0.025 s an image, 0.2 s fixed
    assert batch_line(32, 1.0, 16, 0.6) == (pytest.approx(0.2), pytest.approx(0.025))
    assert batch_line(1, 3.0, 2, 5.0) == (pytest.approx(1.0), pytest.approx(2.0))
    # a line through negative seconds at batch 0: all proportional
    assert batch_line(32, 1.0, 16, 0.4) == (0.0, pytest.approx(1 / 32))
    # the smaller batch measured slower (noise): no gain from batch size is promised
    assert batch_line(32, 1.0, 16, 1.1) == (0.0, pytest.approx(1 / 32))


def test_calibration_says_what_it_measures_and_how_long_is_left():
    """A line before each measurement (calibrate's rounds take minutes each), with the time left
    from the times each took before: a lower bound while some have not run yet."""
    from scaletrain.perfmodel.rounds import duration, rounds

    now = [0.0]

    def taking(seconds, value):
        def measure():
            now[0] += seconds
            return {"x": value}
        return measure

    lines = []
    medians, _ = rounds({"a": taking(60, 1.0), "b": taking(240, 2.0)}, 3, lines.append, clock=lambda: now[0])
    assert lines == ["  round 1 of 3: a, b",
                     "    a: 1 of 6, 0 s in",
                     "    b: 2 of 6, 60 s in, at least 2 min left",
                     "  round 2 of 3: a, b",
                     "    a: 3 of 6, 5 min in, about 10 min left",
                     "    b: 4 of 6, 6 min in, about 9 min left",
                     "  round 3 of 3: a, b",
                     "    a: 5 of 6, 10 min in, about 5 min left",
                     "    b: 6 of 6, 11 min in, about 4 min left"]
    assert medians == {"a": {"x": 1.0}, "b": {"x": 2.0}}
    assert duration(3 * 3600 + 20 * 60) == "3 h 20 min"


def test_median_profile_of_several_calibrations(tmp_path):
    from scaletrain.perfmodel.calibrate import median_profile

    base, _ = load_profile(ROOT / "profiles/study-k80.toml")
    paths = []
    for i, (compute, bw) in enumerate([(0.3, 1e9), (0.2, 4e9), (0.5, 2e9)]):
        paths.append(tmp_path / f"p{i}.toml")
        paths[-1].write_text(dump_profile(replace(base, compute_s=compute, net_bandwidth=bw),
                                          {"transfer_load": 1.0 + i}))
    prof, about = median_profile(paths)
    assert (prof.compute_s, prof.net_bandwidth, prof.model) == (0.3, 2e9, base.model)
    assert about["spread"]["compute_s"] == pytest.approx((0.5 - 0.2) / 0.3)
    assert about["spread"]["net_bandwidth"] == pytest.approx(3e9 / 2e9) and about["transfer_load"] == 2.0
    assert load_profile(paths[0])[0].compute_s == 0.3
    paths[2].write_text(dump_profile(replace(base, model="resnet18"), {}))
    with pytest.raises(ProfileError, match=r"p2.toml: model = 'resnet18', not 'resnet50'"):
        median_profile(paths)


# --- on this machine: calibrate, bench, validate, report ---------------------------------------

def run(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "scaletrain", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600)


def test_predict_cli_table_json_and_errors():
    args = ["predict", "--profile", "profiles/study-k80.toml", "--recipe", "recipes/anp-resnet50.toml",
            "--set", "cluster.gpus_per_node=4", "--grid", "cluster.nodes=1,2", "--grid",
            "strategy.name+cluster.num_ps=sync:1,mixed-async:1"]
    r = run(*args)
    assert r.returncode == 0, r.stderr
    assert "| sync, 2 nodes (2 workers x 4 replicas + 1 PS alongside) |" in r.stdout
    rows = json.loads(run(*args, "--format", "json").stdout)
    assert [r["method"] for r in rows] == ["simulation"] * 4  # every PS configuration
    assert all(r["link_bytes_per_step"] is not None and r["bottleneck"] for r in rows)
    r = run("predict", "--profile", "profiles/study-k80.toml", "--recipe", "recipes/digits.toml")
    assert r.returncode == 2 and "measured for resnet50" in r.stderr and "Traceback" not in r.stderr
    r = run("predict", "--profile", "profiles/nope.toml", "--recipe", "recipes/digits.toml")
    assert r.returncode == 2 and "profile profiles/nope.toml not found" in r.stderr


def test_epoch_time_is_images_over_throughput_and_the_study_trains_in_its_hours():
    from scaletrain.perfmodel.predict import add_time, human_time

    row = add_time(predict(cfg_of("allreduce", nodes=2, gpus=4), TOY), 1_000_000, 3)
    assert row["epoch_s"] == pytest.approx(1_000_000 / row["images_per_sec"])
    assert row["train_hours"] == pytest.approx(3 * row["epoch_s"] / 3600)
    assert "epoch_s" not in add_time(predict(cfg_of(), TOY), 0, 3)  # no data set size, no epoch time
    # the study profile's one node: its 39.5 epochs of 1.2 million images take the study's ~106 hours
    r = run("predict", "--profile", "profiles/study-k80.toml", "--recipe", "recipes/anp-resnet50.toml",
            "--set", "cluster.gpus_per_node=4", "--set", "cluster.nodes=1", "--format", "json")
    one = json.loads(r.stdout)[0]
    assert one["epoch_images"] == 1_200_000 and one["train_hours"] == pytest.approx(106, rel=0.05)
    r = run("predict", "--profile", "profiles/study-k80.toml", "--recipe", "recipes/anp-resnet50.toml",
            "--set", "cluster.gpus_per_node=4", "--images", "600000", "--epochs", "2")
    assert r.returncode == 0 and "| Epoch | Training time |" in r.stdout
    assert r.stdout.strip().endswith(f"| {human_time(2 * 600_000 / one['images_per_sec'])} |"), r.stdout


def test_a_slowed_node_sleeps_without_holding_a_core():
    # strategy.slow_delay_s is a sleep: on a shared host (2 cores, 4 replicas of 1 s compute) the
    # step is bound by the cores' work, which a sleep of 1 s on one node does not add to.
    p = replace(TOY, shared_cores=2, optimizer_s=0.0)
    even, _ = estimate(p, make_setup(cfg_of(nodes=2, gpus=2), p))
    slowed, _ = estimate(p, make_setup(cfg_of(nodes=2, gpus=2, strategy__slow_node=1, strategy__slow_delay_s=1.0), p))
    assert even.step_s == pytest.approx(4 * (1.0 + costs.ring_allreduce_s(4, G, 1e7, 1e-3)) / 2)
    assert slowed.step_s == pytest.approx(even.step_s) and slowed.straggler_s == pytest.approx(1.0)
    # In the simulation too: a backup (b = 1) leaves the sleeping node behind at no cost to the others.
    shape = dict(nodes=3, ps=1, where="dedicated")
    sync = simulate(p, make_setup(cfg_of("sync", **shape), p), cycle_hint=3.0)
    st = make_setup(cfg_of("backup", **shape, strategy__backup_workers=1, strategy__slow_node=1,
                           strategy__slow_delay_s=10.0), p)
    backup = simulate(p, st, cycle_hint=3.0)
    # the slowed node pushes once in 11 s, the two others every 1.7 s: one gradient in 15 is dropped
    assert 0.03 < backup.dropped_fraction < 0.1
    assert backup.images_per_sec > 0.9 * sync.images_per_sec
    # the job's images are those of the applied gradients (as a run's images_applied), not of every push
    pushed = st.pushers * st.pusher_replicas * p.batch_per_replica / backup.step_s
    assert backup.images_per_sec == pytest.approx(pushed * (1 - backup.dropped_fraction), rel=0.03)


# --- pipeline stages ----------------------------------------------------------------------------

def test_pipeline_stages_by_hand():
    """resnet8 at 16 px in 2 stages split by parameters: its classifier of 1,200 classes (78k parameters) is a
    stage, after layer3.0's 64 channels of 4 x 4 (4,096 bytes an image). 2 replicas of 2 stages, 4 micro-batches of 8 images: slots of 1.0 x 8/32 / 2 s,
    5 of them (the bubble is the one more), each micro-batch's activations there and back, then each stage's
    half of the gradient in a ring of 2, and half the optimizer."""
    cfg = cfg_of(gpus=4, parallel__stages=2, parallel__microbatches=4)
    st = make_setup(cfg, TOY)
    assert (st.stages, st.replicas, st.boundary_bytes, st.held) == (2, 2, 4096, 2)
    est, method = estimate(TOY, st)
    slot, act = 0.125, 2 * (1e-3 + 8 * 4096 / 1e7)
    ring = 2 * (1e-3 + G / 2 / 2 / 1e7)
    assert method == "closed form" and est.parts["bubble"] == pytest.approx(slot)
    assert est.step_s == pytest.approx(4 * slot + slot + 5 * act + ring + 0.005)
    assert est.images_per_step == 64
    row = predict(cfg, TOY)
    assert row["replicas"] == 2 and row["stages"] == 2 and "of 2 stages" in __import__(
        "scaletrain.perfmodel.scaling", fromlist=["setup"]).setup(row)


def test_stages_fit_what_one_device_cannot_and_recommend_says_so():
    """1 GB of weights and 0.1 GB an image on 2 GB devices: 32 images need 4.2 GB on one; in 2 stages of 1F1B
    (4 micro-batches, the first stage holding 2) 0.5 + 0.5 x 3.2 / 2 = 1.3 GB; GPipe holds all 4: 2.1 GB."""
    small = replace(TOY, device_memory=2_000_000_000, memory_base=1_000_000_000, memory_per_image=100_000_000)
    with pytest.raises(ModelError, match="batch 32 per replica needs 4.20 GB"):
        predict(cfg_of(gpus=4), small)
    row = predict(cfg_of(gpus=4, parallel__stages=2), small)
    assert row["stage_memory"] == 1_300_000_000
    with pytest.raises(ModelError, match="in 2 stages needs 2.10 GB a stage"):
        predict(cfg_of(gpus=4, parallel__stages=2, parallel__schedule="gpipe"), small)
    best = recommend(cfg_of(gpus=4), small, 2, progress=False)[0]
    assert best["best"]["stages"] == 2 and best["best"]["strategy"] == "allreduce"
    assert "2 stages a replica: 32 images need 4.2 GB on one device > 2.0 GB" in best["batch_reason"]
    assert recommend(cfg_of(gpus=4), TOY, 2, progress=False)[0]["best"]["stages"] == 1  # no limit: no bubble
