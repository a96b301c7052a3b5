"""Pipeline stages, the pure parts: split points, the plan's stages, the config's refusals."""

import itertools
import random

import pytest
import torch
from torch import nn

from scaletrain.config import load_config
from scaletrain.errors import ConfigError, PlanError
from scaletrain.models.resnet import resnet
from scaletrain.pipeline import balance, layers, measure, named_starts
from scaletrain.plan import ClusterConfig, format_table, make_plan


def brute(costs, stages):
    """The smallest largest part over every contiguous split."""
    n = len(costs)
    return min(max(sum(costs[a:b]) for a, b in zip((0, *cuts), (*cuts, n)))
               for cuts in itertools.combinations(range(1, n), stages - 1))


@pytest.mark.parametrize("seed", range(20))
def test_balance_finds_the_best_split(seed):
    rng = random.Random(seed)
    costs = [rng.uniform(0.1, 5) for _ in range(rng.randint(4, 9))]
    stages = rng.randint(2, min(4, len(costs)))
    starts = balance(costs, stages)
    assert starts[0] == 0 and starts == sorted(set(starts)) and len(starts) == stages
    parts = [sum(costs[a:b]) for a, b in zip(starts, [*starts[1:], len(costs)])]
    assert max(parts) == pytest.approx(brute(costs, stages))


def test_balance_by_hand():
    assert balance([1, 1, 1, 1], 2) == [0, 2]
    assert balance([4, 1, 1, 1, 1], 2) == [0, 1]
    assert balance([1, 1, 1, 9], 2) == [0, 3]
    with pytest.raises(ConfigError, match="the network has 2 layers"):
        balance([1, 1], 3)


def test_stages_on_gpus_need_nccl():
    from scaletrain.pipeline import backend_refused
    assert backend_refused("cuda", "nccl") is None and backend_refused("cpu", "gloo") is None
    assert "needs NCCL" in backend_refused("cuda", "gloo")


def test_named_split_points():
    names = ["stem", "layer1.0", "layer2.0", "fc"]
    assert named_starts(names, ["layer2.0"]) == [0, 2]
    with pytest.raises(ConfigError, match="no layer 'layer9'"):
        named_starts(names, ["layer9"])
    with pytest.raises(ConfigError, match="does not come after"):
        named_starts(names, ["layer2.0", "layer1.0"])


def test_resnet_layers_compose_to_its_forward():
    m = resnet("resnet20", 10, "group").eval()
    named = layers(m)
    assert [n for n, _ in named][:3] == ["stem", "layer1.0", "layer1.1"] and named[-1][0] == "fc"
    x = torch.randn(2, 3, 16, 16)
    assert torch.equal(nn.Sequential(*[l for _, l in named])(x), m(x))


def test_a_network_without_layers_is_refused():
    class Net(nn.Module):
        def forward(self, x):
            return x
    with pytest.raises(ConfigError, match="Net cannot be split into stages: give it a method pipeline_layers"):
        layers(Net())


def test_measuring_leaves_the_model_and_the_random_state_as_they_were():
    m = resnet("resnet8", 10, "batch")
    before = {k: v.clone() for k, v in m.state_dict().items()}
    x = torch.randn(4, 3, 16, 16)
    state = torch.get_rng_state()
    prof = measure([l for _, l in layers(m)], x, torch.device("cpu"), "fp32", True)
    assert torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())
    assert all(p.grad is None for p in m.parameters())
    assert len(prof.seconds) == 5 and all(s > 0 for s in prof.seconds)
    assert prof.shapes[0] == (16, 16, 16) and prof.params[-1] == 64 * 10 + 10


def test_plan_places_the_stages_of_a_replica_side_by_side():
    plan = make_plan(ClusterConfig(nodes=2, gpus_per_node=4), False, gpus=4, stages=2)
    assert plan.replicas == 4 and plan.stages == 2
    w = plan.workers
    assert [(p.replica, p.stage) for p in w[:4]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [p.device for p in w[:4]] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert [plan.replica_of(p) for p in w] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert plan.pipeline_of(w[5]) == [4, 5]
    table = format_table(plan)
    assert "GPUs 0-3: 2 replicas x 2 stages" in table and "worker 5 (replica 2, stage 2)" in table
    with pytest.raises(PlanError, match="not a multiple of parallel.stages = 2"):
        make_plan(ClusterConfig(gpus_per_node=3), False, stages=2)


@pytest.mark.parametrize("overrides, pattern", [
    (["parallel.stages=2"], "cluster.gpus_per_node = 1: a replica takes parallel.stages = 2"),
    (["parallel.stages=2", "cluster.gpus_per_node=2", "data.batch_size=30"], "not a multiple of parallel.microbatches"),
    (["parallel.stages=2", "cluster.gpus_per_node=2", "strategy.name=async", "cluster.num_ps=1"],
     "composes with strategy.name = allreduce or sync; not 'async'"),
    (["parallel.stages=2", "cluster.gpus_per_node=2", "train.compile=true"], "train.compile = True: not with"),
    (["parallel.stages=3", "cluster.gpus_per_node=3", "parallel.split=['layer1.0']"], "2 names"),
])
def test_config_refuses_what_stages_do_not_compose_with(overrides, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config(None, overrides)


def test_replicas_count_stages():
    cfg = load_config(None, ["parallel.stages=2", "cluster.gpus_per_node=4", "cluster.nodes=2", "data.batch_size=8"])
    from scaletrain.schedule import step_images
    from scaletrain.strategies.traits import images_per_update
    assert step_images(cfg) == images_per_update(cfg) == 2 * 2 * 8


def test_the_pairs_warmed_at_start_up_are_those_evaluation_and_checkpoints_use():
    """Evaluation sends each stage's activations to the next on every replica; a checkpoint gathers every
    later stage of replica 0 into its first. Under NCCL each such pair builds a communicator of its own at
    its first single send: every one is warmed at start-up, in an order both of its processes reach."""
    from scaletrain.pipeline import p2p_pairs

    assert p2p_pairs([0, 1], 0) == [(0, 1)]  # evaluation's (0 -> 1) is the gather's pair (1 -> 0) too
    assert p2p_pairs([2, 3], 1) == [(2, 3)]
    assert p2p_pairs([0, 1, 2, 3], 0) == [(0, 1), (2, 0), (3, 0), (1, 2), (2, 3)]
    assert p2p_pairs([4, 5, 6, 7], 1) == [(4, 5), (5, 6), (6, 7)]  # no gather: replica 0's stages hold the same
    # the order is deadlock-free: played out with blocking exchanges, every process gets through its pairs
    for ranks, replica in (([0, 1, 2, 3], 0), ([0, 1, 2, 3, 4, 5], 0), ([8, 9, 10], 0)):
        todo = {r: [p for p in p2p_pairs(ranks, replica) if r in p] for r in ranks}
        while any(todo.values()):
            ready = [p for p in {ps[0] for ps in todo.values() if ps} if all(todo[r][0] == p for r in p)]
            assert ready, todo  # some pair's both processes are at it
            for a, b in ready:
                todo[a].pop(0)
                todo[b].pop(0)
