"""Bands on predicted figures (perfmodel/bands.py), on hand-made profiles and runs: a band holds
its point figure, widens with the spread it rests on, combines separate figures in quadrature,
and is absent where nothing has a spread; recommend says when the best two overlap; seeds and
the test set's error give a band on the updates to a target."""

import json
import math
from dataclasses import replace

import pytest

from scaletrain.cli import main
from scaletrain.config import dump_toml, load_config
from scaletrain.perfmodel.bands import band, coverage, field_spreads
from scaletrain.perfmodel.predict import predict
from scaletrain.perfmodel.profile import Profile, dump_profile
from scaletrain.perfmodel.recommend import recommend, recommend_table, within
from scaletrain.perfmodel.statistical import add_target, read_learning

# Two replicas a node, a network slow enough to matter: a 2-node all-reduce (closed form, fast).
TOY = Profile(model="resnet8", image_size=16, batch_per_replica=32, gradient_bytes=10_000_000, replicas_per_node=2,
              compute_s=0.5, optimizer_s=0.01, intra_bandwidth=1e10, intra_latency=1e-5, net_bandwidth=1e8,
              net_latency=1e-4, local_bandwidth=1e10, ps_apply_rate=1e10, ps_accumulate_rate=1e11)
RECIPE = ["model.name=resnet8", "data.image_size=16", "data.batch_size=32", "cluster.gpus_per_node=2",
          "cluster.nodes=2", "strategy.name=allreduce", "cluster.num_ps=0"]


def banded(spreads, p=TOY):
    cfg = load_config(None, RECIPE)
    row = predict(cfg, p)
    return row, band(row, p, spreads, lambda q: predict(cfg, q))


def test_a_band_holds_its_point_and_widens_with_the_spread():
    row, narrow = banded({"compute_s": 0.1, "net_bandwidth": 0.2})
    _, wide = banded({"compute_s": 0.3, "net_bandwidth": 0.6})
    for key in ("images_per_sec", "speedup", "efficiency", "step_s"):
        assert narrow[key][0] < row[key] < narrow[key][1], key
        assert wide[key][0] < narrow[key][0] and wide[key][1] > narrow[key][1], key
    # a slower network lowers throughput: the lower edge comes from net_bandwidth x 0.9 (and compute x 1.05)
    slow = predict(load_config(None, RECIPE), replace(TOY, net_bandwidth=TOY.net_bandwidth * 0.9))
    assert narrow["images_per_sec"][0] < slow["images_per_sec"] < row["images_per_sec"]


def test_separate_figures_combine_in_quadrature():
    row, compute = banded({"compute_s": 0.2})
    _, network = banded({"net_bandwidth": 0.4})
    _, both = banded({"compute_s": 0.2, "net_bandwidth": 0.4})
    x = row["images_per_sec"]
    down = [1 - b["images_per_sec"][0] / x for b in (compute, network, both)]
    assert down[2] == pytest.approx(math.hypot(down[0], down[1]))
    assert down[2] < down[0] + down[1]


def test_no_spread_no_band(tmp_path, capsys):
    assert banded({})[1] is None
    assert field_spreads({}) == {} and field_spreads({"spread": {"compute_s": 0.0, "model": 0.3}}) == {}
    profile, recipe = tmp_path / "toy.toml", tmp_path / "recipe.toml"
    recipe.write_text(dump_toml(load_config(None, RECIPE)))
    args = ["predict", "--profile", str(profile), "--recipe", str(recipe), "--format", "json"]
    profile.write_text(dump_profile(TOY, {}))
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)[0]["band"] is None
    assert main(args[:-2]) == 0
    out, err = capsys.readouterr()
    assert "gives no spread" in err and "(" not in out.splitlines()[2].split("|")[2]  # the point alone
    profile.write_text(dump_profile(TOY, {"spread": {"compute_s": 0.2}}))
    assert main(args) == 0
    row = json.loads(capsys.readouterr().out)[0]
    assert row["band"]["images_per_sec"][0] < row["images_per_sec"] < row["band"]["images_per_sec"][1]
    assert main(args[:-2]) == 0
    out, err = capsys.readouterr()
    assert "gives no spread" not in err and f"{row['images_per_sec']:.1f} (" in out


def test_a_single_calibrations_measurements_map_to_the_fields_they_set():
    spreads = field_spreads({"spread": {"job1.step_s": 0.1, "p2p.p2p_1": 0.05, "p2p.p2p_4000000": 0.2,
                                        "p2p.ar_4000000": 0.4, "ps_job.step_s": 0.3, "cpu.optimizer_s": 0.04,
                                        "input.images": 0.5}})
    assert spreads == {"compute_s": 0.1, "net_latency": 0.05, "net_bandwidth": 0.3, "local_bandwidth": 0.3,
                       "intra_bandwidth": 0.4, "optimizer_s": 0.04, "ps_apply_rate": 0.04}
    # with an all-reduce over more processes measured, the pair's all-reduce sets nothing
    assert "intra_bandwidth" not in field_spreads({"spread": {"p2p.ar_4000000": 0.4, "allreduce.ar_1": 0.1}})
    # with the pair placed across the network (the twin, two Slurm nodes), the network's figures are
    # that pair's, and the loopback pair's spread reaches only local_bandwidth
    placed = field_spreads({"spread": {"p2p.p2p_1": 0.05, "p2p.p2p_4000000": 0.2, "net.p2p_1": 0.02,
                                       "net.p2p_3000000": 0.1}})
    assert placed == {"net_latency": 0.02, "net_bandwidth": 0.1, "local_bandwidth": 0.2}


def test_recommend_says_when_the_best_two_are_within_each_others_bands():
    # Network and PS far faster than compute: allreduce and sync within 1%, and a 20% compute spread
    fast = replace(TOY, net_bandwidth=1e12, intra_bandwidth=1e12, local_bandwidth=1e12, ps_apply_rate=1e12,
                   ps_accumulate_rate=1e12)
    cfg = load_config(None, RECIPE)
    entries = recommend(cfg, fast, 2, progress=False, spreads={"compute_s": 0.2})
    two = entries[-1]
    assert two["best"]["band"] and two["runners_up"][0][0]["band"]
    assert two["overlap"].startswith("the best two are within each other's bands: ")
    assert "img/s" in two["overlap"] and " (" in recommend_table(entries, "throughput")
    unbanded = [{**r, "band": None} for r in (two["best"], two["runners_up"][0][0])]
    assert within(*unbanded, "throughput") is None  # no spread, no band, no sentence
    # bands that do not meet
    a = {"images_per_sec": 100.0, "dropped_fraction": 0.0, "band": {"images_per_sec": [95.0, 105.0]},
         "strategy": "allreduce", "nodes": 2, "nodes_total": 2, "gpus_per_node": 2, "num_ps": 0}
    b = {**a, "images_per_sec": 90.0, "band": {"images_per_sec": [85.0, 94.0]}}
    assert within(a, b, "throughput") is None
    assert within(a, {**b, "band": {"images_per_sec": [85.0, 96.0]}}, "throughput")


def run_dir(path, reached, accuracy_before=0.5, test_images=1000):
    """A synchronous run of 2 replicas x 16 images that reached accuracy 0.9 at `reached` images, its
    evaluation before at half of that."""
    path.mkdir()
    (path / "config.toml").write_text(dump_toml(load_config(None, ["data.batch_size=16", "cluster.gpus_per_node=2"])))
    rows = [{"kind": "train", "step": 10, "images": 320, "loss": 1.0, "noise_scale": 8.0},
            {"kind": "eval", "step": 1, "images": reached // 2, "test_accuracy": accuracy_before},
            {"kind": "eval", "step": 2, "images": reached, "test_accuracy": 0.9}]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (path / "summary.json").write_text(json.dumps({"test_images": test_images}))
    return path


def test_seeds_and_the_test_sets_error_band_the_updates_to_the_target(tmp_path):
    one = read_learning(run_dir(tmp_path / "a", 32000), ("accuracy", 0.9))
    # sqrt(0.9 x 0.1 / 1000) = 0.0095 accuracy; the secant climbs 0.4 in 16,000 images: 380 images, 1.2%
    assert one.seeds == 1 and one.seed_spread == 0
    assert one.eval_error == pytest.approx(math.sqrt(0.09 / 1000) / (0.4 / 16000) / 32000)
    seeds = read_learning([tmp_path / "a", run_dir(tmp_path / "b", 28000), run_dir(tmp_path / "c", 36000)],
                          ("accuracy", 0.9))
    assert (seeds.seeds, seeds.images) == (3, 32000) and seeds.seed_spread == pytest.approx(0.25)
    assert seeds.band() == pytest.approx(math.hypot(0.125, seeds.eval_error))
    cfg = load_config(None, RECIPE)
    row = add_target(predict(cfg, TOY), cfg, seeds)
    b = band(row, TOY, {}, lambda q: add_target(predict(cfg, q), cfg, seeds), seeds.band())
    assert set(b) == {"target_updates", "target_images", "target_hours"}  # the profile gives none
    for key in b:
        assert b[key][0] == pytest.approx(row[key] * (1 - seeds.band()))
        assert b[key][1] == pytest.approx(row[key] * (1 + seeds.band()))


def test_coverage_counts_the_measured_figures_inside_their_bands():
    assert coverage([(100.0, [90.0, 110.0]), (120.0, [90.0, 110.0]), (50.0, None)]) == \
        {"coverage": 0.5, "inside": 1, "rows": 2}
    none = coverage([(100.0, None)], "the profile gives no spread")
    assert none["coverage"] is None and none["reason"] == "the profile gives no spread"


def test_a_shared_error_moves_the_best_two_alike_and_keeps_their_order():
    """Bands that overlap need not mean a tie: both configurations run on the same GPUs. A compute
    spread moves allreduce and sync alike and their order holds; a network spread moves only the
    one that waits on the network, and then either may lead."""
    fast = replace(TOY, net_bandwidth=1e12, intra_bandwidth=1e12, local_bandwidth=1e12, ps_apply_rate=1e12,
                   ps_accumulate_rate=1e12)
    cfg = load_config(None, RECIPE)
    two = recommend(cfg, fast, 2, progress=False, spreads={"compute_s": 0.2})[-1]
    assert "moved together by the profile's spread, the first stays ahead" in two["overlap"]
    # a slow network that only the best waits on, known to within +-40%: its lead may go
    slow = replace(fast, net_bandwidth=2.2e8)
    two = recommend(cfg, slow, 2, progress=False, spreads={"net_bandwidth": 0.8})[-1]
    assert two["overlap"] and "either may lead" in two["overlap"], two
