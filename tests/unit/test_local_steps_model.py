"""local-sgd and diloco in the config checks and the performance model (no processes)."""

import pytest

from scaletrain.config import build_config
from scaletrain.errors import ConfigError
from scaletrain.perfmodel import costs
from scaletrain.perfmodel.predict import predict, single_node
from scaletrain.perfmodel.setup import make_setup
from scaletrain.strategies import images_per_update

from test_perfmodel import G, TOY, cfg_of


@pytest.mark.parametrize("strategy,key,value,readers", [
    ("allreduce", "sync_every", 4, "local-sgd or diloco"), ("sync", "sync_every", 16, "local-sgd or diloco"),
    ("local-sgd", "outer_lr", 1.0, "diloco"), ("allreduce", "outer_momentum", 0.5, "diloco")])
def test_a_local_key_set_for_a_strategy_that_does_not_read_it_is_refused(strategy, key, value, readers):
    with pytest.raises(ConfigError, match=f"strategy.{key} = {value}: read by strategy.name = {readers} only"):
        build_config({"strategy": {"name": strategy, key: value}, "cluster": {"num_ps": int(strategy == "sync")}})
    build_config({"strategy": {"name": "diloco", key: value}})


def test_local_steps_refuse_what_they_cannot_do():
    with pytest.raises(ConfigError, match="strategy.emulate_workers = 2: emulates asynchronous workers"):
        build_config({"strategy": {"name": "local-sgd", "emulate_workers": 2}})
    with pytest.raises(ConfigError, match="train.ema_decay = 0.99: averages the job's weights after every update; "
                                          "under strategy.name = 'diloco' each replica holds its own"):
        build_config({"strategy": {"name": "diloco"}, "train": {"ema_decay": 0.99}})
    for key, value in (("outer_lr", 0.0), ("sync_every", 65)):  # no training; past the staleness histogram
        with pytest.raises(ConfigError, match=f"strategy.{key}"):
            build_config({"strategy": {"name": "diloco", key: value}})


def test_local_steps_learn_at_allreduces_rate():
    """The learning-rate rule's unit is the global batch, as all-reduce's."""
    sets = dict(nodes=2, gpus=2, data__batch_size=16)
    assert images_per_update(cfg_of("local-sgd", **sets)) == images_per_update(cfg_of(**sets)) == 64


@pytest.mark.parametrize("name", ["local-sgd", "diloco"])
def test_local_steps_carry_an_eighth_of_the_ring(name):
    """sync_every 8: an eighth of all-reduce's network time and bytes a step, staleness 0..7."""
    sync, local = (costs.allreduce(TOY, make_setup(cfg_of(s, nodes=2, gpus=2, **more), TOY))
                   for s, more in (("allreduce", {}), (name, {"strategy__sync_every": 8})))
    ring = 2 * 3 * (0.01 + G / 4 / 1e6)
    assert sync.parts["network"] == pytest.approx(ring) and local.parts["network"] == pytest.approx(ring / 8)
    assert local.link_bytes["node 1"] == pytest.approx(sync.link_bytes["node 1"] / 8)
    outer = 0.01 / 8 if name == "diloco" else 0.0  # the outer optimizer's step at each meeting
    assert local.step_s == pytest.approx(1.0 + ring / 8 + 0.01 + outer)
    assert (local.staleness_mean, local.staleness_p95) == (3.5, 7) and sync.staleness_mean is None


def test_a_local_configuration_has_all_reduces_baseline():
    """The baseline (one node, all-reduce) leaves the local keys at their defaults: a key it kept would be
    refused under all-reduce."""
    cfg = cfg_of("diloco", nodes=4, strategy__sync_every=16, strategy__outer_lr=1.0)
    base = single_node(cfg)
    assert base.strategy.name == "allreduce" and base.strategy.sync_every == 8 and base.strategy.outer_lr == 0.5
    row = predict(cfg, TOY)
    assert row["speedup"] > 3.5 and row["staleness_mean"] == 7.5


def test_a_bench_baseline_resets_only_the_strategy_keys_a_configuration_sets():
    """A grid's added baseline (study/bench.py) names the local keys only where the configuration set them."""
    from scaletrain.perfmodel.scaling import baseline_cell

    cell = {"cluster.nodes": "2", "strategy.name": "local-sgd"}
    plain = baseline_cell(cell, cfg_of("local-sgd", nodes=2).flat())
    assert plain == {"strategy.name": "allreduce", "cluster.nodes": "1", "cluster.num_ps": "0",
                     "strategy.backup_workers": "0", "strategy.slow_node": "-1"}
    assert baseline_cell(cell, cfg_of("local-sgd", nodes=2, strategy__sync_every=4).flat()) == \
        {**plain, "strategy.sync_every": "8"}


def test_replicas_meet_at_the_multiples_the_end_and_a_stop():
    """Where a sync point waits for the next meeting and where a stop brings one forward (local.meeting)."""
    from scaletrain.comm.liveness import CHECKPOINT, STOP
    from scaletrain.strategies.local import meeting

    assert meeting(5, 3, False, 0, True) == (False, False)  # a point came: it waits for step 6
    assert meeting(5, 3, False, CHECKPOINT, False) == (False, False)  # so does a timed checkpoint
    assert meeting(6, 3, False, 0, False) == (True, False)  # a meeting, no point due
    assert meeting(6, 3, False, 0, True) == (True, True)
    assert meeting(6, 3, False, CHECKPOINT, False) == (True, True)
    assert meeting(5, 3, False, STOP, False) == (True, True)  # a stop does not wait
    assert meeting(7, 3, True, 0, False) == (True, True)  # the end
