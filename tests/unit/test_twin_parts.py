"""The cluster twin's pure parts: the self-test's pairs, tbf's bucket, the cluster-speed figures, the keys."""

import pytest

from scaletrain.errors import ConfigError
from scaletrain.twin import netns, selftest
from scaletrain.twin.dilation import cluster_figures


def test_the_self_test_loads_every_nodes_link_both_ways_at_once():
    assert selftest.pairs(2) == [(0, 1), (1, 0)]
    assert selftest.pairs(4) == [(0, 1), (1, 2), (2, 3), (3, 0)]
    for n in range(2, 12):
        assert sorted(s for s, _ in selftest.pairs(n)) == sorted(d for _, d in selftest.pairs(n)) == list(range(n))
    assert selftest.pairs(1) == []


def test_tbf_holds_two_milliseconds_at_the_rate_and_never_under_64_kib():
    args = netns.tbf(10.0)
    assert args[:3] == ["tbf", "rate", "10000000000bit"]
    assert int(args[args.index("burst") + 1]) == 10e9 / 8 * 0.002
    assert int(netns.tbf(0.001)[4]) == 64 * 1024


def test_a_dilated_jobs_figures_are_the_clusters(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "twin.json").write_text('{"self_test": {"ratio": 0.95}}')
    measured = {"images_per_sec": 10.0, "images_per_sec_stderr": 1.0, "train_seconds": 40.0, "wall_seconds": 50.0,
                "emulated_compute_s": 0.3, "time_split_s": {"compute_s": 12.0, "comm_s": 8.0}, "steps": 100,
                "per_worker": [{"rank": 0, "computed_images_per_sec": 5.0, "steps": 100}], "staleness_mean": 1.5}
    out = cluster_figures(measured, 4.0, tmp_path)
    assert out["images_per_sec"] == 40.0 and out["images_per_sec_stderr"] == 4.0
    assert out["train_seconds"] == 10.0 and out["wall_seconds"] == 12.5
    assert out["time_split_s"] == {"compute_s": 3.0, "comm_s": 2.0}
    assert out["per_worker"] == [{"rank": 0, "computed_images_per_sec": 20.0, "steps": 100}]
    assert (out["steps"], out["staleness_mean"], out["emulated_compute_s"]) == (100, 1.5, 0.3)  # counts and settings
    assert out["twin"]["time_scale"] == 4.0 and out["twin"]["self_test"] == {"ratio": 0.95}
    assert cluster_figures(measured, 1.0, tmp_path)["images_per_sec"] == 10.0


@pytest.mark.parametrize("sets, words", [
    (["cluster.time_scale=4", "train.emulate_compute_s=0.1", "train.eval_every=0"], "cluster.time_scale = 4.0: acts in the cluster twin only"),
    (["cluster.slow_link_node=1"], "cluster.slow_link_node = 1: acts in the cluster twin only"),
    (["cluster.network=netns", "cluster.slow_link_node=2"], "cluster.slow_link_node = 2: no such node"),
    (["cluster.network=netns", "cluster.time_scale=4"], "dilates emulated compute only"),
    (["cluster.network=ether"], "cluster.network"),
])
def test_twin_keys_that_cannot_act_are_refused_in_one_line(digits_cfg, sets, words):
    with pytest.raises(ConfigError, match=words.replace(".", r"\.")) as e:
        digits_cfg("cluster.nodes=2", "cluster.num_ps=1", "strategy.name=sync", *sets)
    assert "\n" not in str(e.value)


def test_without_root_the_twin_says_why(monkeypatch):
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    assert netns.privileges() == "cluster.network = netns needs root (network namespaces, veth pairs and tc shaping)"


def test_a_dilated_jobs_rows_are_the_clusters_too():
    from scaletrain.twin.dilation import cluster_row

    row = {"images": 640, "epoch": 0.5, "wall": 8.0, "train_wall": 6.0, "loss": 2.0, "lr": 0.1,
           "images_per_sec": 100.0, "data_wait_fraction": 0.25}
    assert cluster_row(row, 2.0) == {**row, "wall": 4.0, "train_wall": 3.0, "images_per_sec": 200.0}
    assert cluster_row(row, 1.0) is row


def test_a_short_round_is_measured_again_and_only_a_twin_short_in_every_round_is_refused(monkeypatch):
    """The retry policy alone (the real links: test_twin.py): a round short of the bound is measured
    again; the first round that passes is the one reported; three short rounds refuse the twin, naming
    the best round's worst pair and rate."""
    from scaletrain.errors import LaunchError
    twin = netns.Twin("policy", 2, [1.0, 1.0])
    rounds = iter([[0.5, 0.95], [0.95, 0.94]])  # Gbit/s of pairs (1 -> 2, 2 -> 1) a round
    monkeypatch.setattr(selftest, "measure", lambda *_: next(rounds))
    got = selftest.check(twin)
    assert got["rounds"] == 2 and got["measured_gbps"] == [0.95, 0.94]
    rounds = iter([[0.5, 0.9], [0.9, 0.6], [0.4, 0.9]])
    with pytest.raises(LaunchError, match=r"delivers 0.6 of the 1 Gbit/s set from node 2 to node 1 .*\(3 rounds"):
        selftest.check(twin)
