"""A cluster described, not measured: the GPU catalogue, the network counted on the meta device,
and the profile a description makes for a recipe (perfmodel/gpus.py, layers.py, cluster.py)."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from scaletrain.config import load_config
from scaletrain.errors import ModelError, ProfileError
from scaletrain.perfmodel import cluster, gpus
from scaletrain.perfmodel.cluster import load_cluster, load_for
from scaletrain.perfmodel.costs import input_s
from scaletrain.perfmodel.layers import step_cost
from scaletrain.perfmodel.predict import predict

ROOT = Path(__file__).resolve().parents[2]
NODES = ROOT / "profiles/nodes"
SMALL = ["model.name=resnet8", "data.image_size=32", "data.batch_size=32", "model.num_classes=10"]


def write(tmp_path: Path, text: str, name: str = "node.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_views_move_no_bytes_and_training_is_three_forwards():
    cfg = load_config(None, SMALL)
    cost = step_cost(cfg.model, 32, 8)
    assert all(o.bytes == 0 for o in cost.ops if o.name in ("aten.view", "aten.t", "aten.expand"))
    convs = sum(o.flops for o in cost.ops if o.name == "aten.convolution")
    backward = sum(o.flops for o in cost.ops if o.name == "aten.convolution_backward")
    assert backward == pytest.approx(2 * convs, rel=0.05)  # grad of input and of weight, less the first layer's input
    assert cost.saved_bytes > 0 and cost.parameters == 78042  # resnet8, 10 classes


def test_the_catalogue_factors_are_the_fit_to_their_published_points():
    """FACTOR holds what benchmarks/gpu_catalogue.py fits: recomputed here for the A100's two points."""
    cfg = load_config(None, ["model.name=resnet50", "model.num_classes=1000"])
    for point in (p for p in gpus.POINTS if p.gpu == "a100-80gb"):
        cost = step_cost(cfg.model, 224, point.batch, half=point.mode == "half")
        got = gpus.fit(cost, gpus.gpu(point.gpu), point.mode, point.images_per_s)
        assert got == pytest.approx(gpus.FACTOR[(point.gpu, point.mode)], abs=1e-3)


def test_the_catalogue_error_is_the_saved_benchmarks():
    saved = json.loads((ROOT / cluster.CATALOGUE_RESULT).read_text())
    assert saved["held_out_error"]["max"] == cluster.CATALOGUE_ERROR
    assert saved["factors"] == {f"{g}/{m}": v for (g, m), v in gpus.FACTOR.items()}


def test_a_network_not_fitted_to_is_priced_by_its_bytes(tmp_path):
    """ResNeXt-101 32x4d (grouped convolutions) on an A100 in bf16, from ResNet-50's factor: the
    roofline lands within 15% of the published 1,211 img/s, where FLOPs alone would say 36% less."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        cfg = load_config(None, ["model.name=catalogue_nets:resnext101_32x4d", "model.num_classes=1000"])
        cost = step_cost(cfg.model, 224, 128, half=True)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    a100 = gpus.gpu("a100-80gb")
    rate = 128 / gpus.step_s(cost, a100, "half", gpus.FACTOR[("a100-80gb", "half")])
    assert abs(rate / 1211 - 1) < 0.15


def test_each_shipped_node_profile_loads():
    for path in sorted(NODES.glob("*.toml")):
        c, about = load_cluster(path)
        assert gpus.gpu(c.gpu) and about["name"]
    assert {p.stem for p in NODES.glob("*.toml")} >= {"k80", "v100", "a100", "h100", "h200"}


@pytest.mark.parametrize("text, says", [
    ('[node]\ngpu = "a100-80gb"\ngpus = 4\nspeed = 3\n', "unknown key node.speed"),
    ('[node]\ngpu = "b300"\n', "node.gpu: GPU 'b300' is not in the catalogue"),
    ('[node]\ngpu = "a100-80gb"\ngpus = 0\n', "node.gpus = 0: out of range"),
    ('[node]\ngpu = "a100-80gb"\n[measured]\nimages_per_s = 100.0\n', "[measured] needs both"),
])
def test_a_bad_description_names_its_file_and_key(tmp_path, text, says):
    path = write(tmp_path, text)
    with pytest.raises(ProfileError, match=str(path)) as e:
        load_cluster(path)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_a_measured_point_replaces_the_catalogue_and_carries_no_band(tmp_path):
    cfg = load_config(None, SMALL)
    text = (NODES / "a100.toml").read_text()
    catalogue, about = load_for(write(tmp_path, text), cfg)
    assert about["spread"] == {"compute_s": pytest.approx(2 * cluster.CATALOGUE_ERROR)}
    measured, about = load_for(write(tmp_path, text + "\n[measured]\nimages_per_s = 3200.0\nbatch = 32\n",
                                     "m.toml"), cfg)
    assert measured.compute_s == pytest.approx(32 / 3200.0, rel=1e-6)
    assert about["spread"] == {} and "[measured]" in about["derived"]["compute"]
    assert measured.compute_s != pytest.approx(catalogue.compute_s, rel=0.01)


def test_precision_picks_the_mode_and_bf16_on_a_v100_is_refused(tmp_path):
    r18 = ["model.name=resnet18", "data.image_size=112", "data.batch_size=64", "model.num_classes=10"]
    fp32, _ = load_for(NODES / "a100.toml", load_config(None, r18))
    bf16, _ = load_for(NODES / "a100.toml", load_config(None, r18 + ["train.precision=bf16"]))
    assert bf16.compute_s < 0.7 * fp32.compute_s  # tensor cores at half precision, and half the bytes
    # a network as small as resnet8 at 32 px waits on the host's launches on any of them
    tiny, _ = load_for(NODES / "a100.toml", load_config(None, SMALL))
    assert tiny.compute_s == pytest.approx(gpus.host_s(step_cost(load_config(None, SMALL).model, 32, 32)))
    with pytest.raises(ModelError, match="v100-16gb has no bf16"):
        load_for(NODES / "v100.toml", load_config(None, SMALL + ["train.precision=bf16"]))


def test_a_batch_the_gpu_cannot_hold_is_refused_in_one_line():
    cfg = load_config(None, ["model.name=resnet50", "data.image_size=224", "data.batch_size=4096", "model.num_classes=1000"])
    with pytest.raises(ModelError, match=r"on the k80, batch 4096 per replica needs [\d.]+ GB") as e:
        load_for(NODES / "k80.toml", cfg)
    assert "\n" not in str(e.value)


def test_loaders_beyond_the_cores_and_the_file_system_bound_the_input(tmp_path):
    base = (NODES / "a100.toml").read_text()
    files = SMALL + ["data.name=imagefolder", f"data.root={tmp_path}", "data.workers=8", "cluster.gpus_per_node=4"]
    cfg = load_config(None, files)
    roomy, _ = load_for(write(tmp_path, base), cfg)
    tight, about = load_for(write(tmp_path, base.replace("cpu_cores = 64", "cpu_cores = 20"), "t.toml"), cfg)
    assert tight.input_rate == pytest.approx(roomy.input_rate * (20 - 4) / (4 * 8))
    assert "run 50% of 4 x 8 loaders" in about["derived"]["input"]
    # 1 Gbit/s of 110 kB files is 1,136 img/s for the whole job, whatever its nodes
    slow, _ = load_for(write(tmp_path, base.replace("read_gbps = 0 ", "read_gbps = 1 "), "s.toml"), cfg)
    assert slow.read_rate == pytest.approx(1e9 / 8 / 110e3)
    for nodes in (1, 4):
        row = predict(load_config(None, files + [f"cluster.nodes={nodes}"]), slow)
        assert row["images_per_sec"] <= slow.read_rate * 1.0001


def test_predict_prices_a_users_network_on_a_described_node(tmp_path, capsys):
    from scaletrain.cli import main
    recipe = write(tmp_path, "[model]\nname = 'resnet8'\nnum_classes = 10\n[data]\nimage_size = 32\n"
                   "batch_size = 64\n", "recipe.toml")
    run = ["predict", "--profile", str(NODES / "h100.toml"), "--recipe", str(recipe), "--grid", "cluster.nodes=1,2",
           "--format", "json"]
    assert main(run) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["images_per_sec"] > 0 for r in rows] == [True, True]
    assert main(run + ["--set", "train.precision=bf16", "--profile", str(NODES / "v100.toml")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no bf16" in err
