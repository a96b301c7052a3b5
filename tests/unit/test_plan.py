"""Placement plan: pure, no processes."""

from __future__ import annotations

import pytest

from scaletrain.plan import ClusterConfig, PlanError, format_table, lost_nodes, make_plan, node_line, node_name


def cluster(**kw) -> ClusterConfig:
    return ClusterConfig(**kw)


def test_study_example_two_nodes_one_ps_alongside():
    plan = make_plan(cluster(nodes=2, gpus_per_node=4, num_ps=1), ps_required=True, gpus=4)
    rows = [(p.rank, p.node, p.local_rank, p.role, p.index, p.replica, p.device) for p in plan.procs]
    assert rows == [
        (0, 0, 0, "worker", 0, 0, "cuda:0"),
        (1, 0, 1, "worker", 1, 1, "cuda:1"),
        (2, 0, 2, "worker", 2, 2, "cuda:2"),
        (3, 0, 3, "worker", 3, 3, "cuda:3"),
        (4, 1, 0, "worker", 4, 0, "cuda:0"),
        (5, 1, 1, "worker", 5, 1, "cuda:1"),
        (6, 1, 2, "worker", 6, 2, "cuda:2"),
        (7, 1, 3, "worker", 7, 3, "cuda:3"),
        (8, 1, 4, "ps", 0, -1, "cpu"),
    ]
    # As the study describes it.
    assert node_line(plan, 0) == "node 1: worker 0 (GPUs 0-3)"
    assert node_line(plan, 1) == "node 2: PS 0 (no GPU) and worker 1 (GPUs 0-3)"
    assert plan.world_size == 9 and plan.nodes_total == 2 and plan.worker_nodes == 2
    assert plan.procs_per_node == [4, 5]
    assert plan.leaders == [0, 4]
    assert [p.rank for p in plan.ps] == [8] and len(plan.workers) == 8
    assert plan.node_of(8) == 1 and [p.rank for p in plan.on_node(0)] == [0, 1, 2, 3]


def shapes():
    for n in (1, 2, 4, 16):
        for p in sorted({1, 3, n}):
            for placement in ("alongside", "dedicated"):
                if placement == "alongside" and p > n:
                    continue
                for g in (1, 4):
                    yield n, g, p, placement


@pytest.mark.parametrize("n,g,p,placement", list(shapes()))
def test_plan_invariants(n, g, p, placement):
    plan = make_plan(cluster(nodes=n, gpus_per_node=g, num_ps=p, ps_placement=placement),
                     ps_required=True, gpus=4)
    assert plan.world_size == n * g + p
    assert [q.rank for q in plan.procs] == list(range(plan.world_size))
    # Ranks contiguous per node, in node order; local ranks count from 0.
    assert [q.node for q in plan.procs] == sorted(q.node for q in plan.procs)
    for node in range(plan.nodes_total):
        on = plan.on_node(node)
        assert [q.local_rank for q in on] == list(range(len(on)))
        roles = [q.role for q in on]
        assert roles == sorted(roles, key=lambda r: r != "worker")  # workers before PS
    assert sum(plan.procs_per_node) == plan.world_size
    assert [q.index for q in plan.workers] == list(range(n * g))
    assert [q.index for q in plan.ps] == list(range(p))
    assert plan.worker_nodes == n
    assert plan.leaders == [plan.on_node(node)[0].rank for node in range(n)]
    assert [plan.procs[r].replica for r in plan.leaders] == [0] * n
    for q in plan.workers:
        assert q.device == f"cuda:{q.replica}"
        assert q.replica == q.local_rank
    for q in plan.ps:
        assert q.device == "cpu" and q.replica == -1
    ps_nodes = [q.node for q in plan.ps]
    if placement == "alongside":
        assert plan.nodes_total == n
        assert len(set(ps_nodes)) == p  # at most one PS per node
        assert (0 in ps_nodes) == (p == n)  # chief's node only when every node has one
        assert ps_nodes == [(k + 1) % n for k in range(p)]
    else:
        assert plan.nodes_total == n + p
        assert ps_nodes == list(range(n, n + p))
        for node in ps_nodes:
            assert [q.role for q in plan.on_node(node)] == ["ps"]


def test_one_node_one_ps_alongside_goes_to_node_zero():
    plan = make_plan(cluster(nodes=1, num_ps=1), ps_required=True)
    assert [(q.role, q.node) for q in plan.procs] == [("worker", 0), ("ps", 0)]


def test_cpu_plan_has_no_gpus():
    plan = make_plan(cluster(nodes=2, gpus_per_node=2), ps_required=False)
    assert {q.device for q in plan.procs} == {"cpu"}
    assert plan.world_size == 4 and plan.ps == ()


def test_format_table():
    plan = make_plan(cluster(nodes=2, gpus_per_node=4, num_ps=1), True, gpus=4)
    lines = format_table(plan, "10.0.0.1", 29500, hosts=["gpu7", "gpu9"]).splitlines()
    assert lines[0] == "2 nodes (2 with workers, 0 PS-only), 9 processes"
    assert lines[1:3] == ["node 1: worker 0 (GPUs 0-3)", "node 2: PS 0 (no GPU) and worker 1 (GPUs 0-3)"]
    assert lines[4].split() == ["node", "host", "rank", "local", "role", "GPU", "port"]
    assert lines[5].split() == ["1", "gpu7", "0", "0", "worker", "0", "0", "29500", "(rendezvous", "at", "10.0.0.1)"]
    assert lines[-1].split() == ["2", "gpu9", "8", "4", "ps", "0", "none", "-"]
    assert format_table(plan).splitlines()[5].endswith("any free (rendezvous)")
    assert len(lines) == 5 + 9


def test_dedicated_ps_nodes_are_counted_and_shown():
    plan = make_plan(cluster(nodes=2, gpus_per_node=1, num_ps=2, ps_placement="dedicated"), True)
    lines = format_table(plan).splitlines()
    assert lines[0] == "4 nodes (2 with workers, 2 PS-only), 4 processes"
    assert lines[1:5] == ["node 1: worker 0 (1 CPU replica)", "node 2: worker 1 (1 CPU replica)",
                          "node 3: PS 0 (no GPU)", "node 4: PS 1 (no GPU)"]


def test_error_ps_required_but_none():
    with pytest.raises(PlanError, match=r"at least one parameter server: set cluster.num_ps >= 1"):
        make_plan(cluster(nodes=2), ps_required=True)


def test_error_ps_given_but_unused():
    with pytest.raises(PlanError, match=r"cluster.num_ps = 2: this strategy uses no parameter server"):
        make_plan(cluster(nodes=2, num_ps=2), ps_required=False)


def test_error_too_many_ps_alongside():
    with pytest.raises(PlanError, match=r"cluster.num_ps = 3 > cluster.nodes = 2: .*alongside"):
        make_plan(cluster(nodes=2, num_ps=3), ps_required=True)
    # The same count is fine on dedicated nodes.
    assert make_plan(cluster(nodes=2, num_ps=3, ps_placement="dedicated"), True).nodes_total == 5


def test_error_bad_shape():
    with pytest.raises(PlanError, match=r"cluster.nodes = 0, cluster.gpus_per_node = 1: both must be >= 1"):
        make_plan(cluster(nodes=0), ps_required=False)


def test_errors_are_one_line():
    for kw, req in (({}, True), ({"num_ps": 1}, False), ({"num_ps": 5, "nodes": 2}, True)):
        with pytest.raises(PlanError) as e:
            make_plan(cluster(**kw), ps_required=req)
        assert "\n" not in str(e.value)


def test_lost_workers_number_nodes_as_the_messages_do():
    plan = make_plan(cluster(nodes=3, gpus_per_node=2), ps_required=False, gpus=0)
    ranks = [p.rank for p in plan.procs if p.node == 2]
    assert lost_nodes(plan, ranks) == {"nodes": [3], "ranks": [4, 5]}
    assert node_name(2) == f"node {lost_nodes(plan, ranks)['nodes'][0]}"  # "the job goes on without node 3"
