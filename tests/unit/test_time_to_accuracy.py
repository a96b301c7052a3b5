"""Time to a target under the performance model (perfmodel/statistical.py), on a toy with a known
answer: a batch per replica of 128 is 3.1x faster per image than 32, but with a gradient noise scale
of 8 images it needs 3.4x the images to the target, so 32 reaches it sooner; ranked by throughput,
128 wins.

The measured run is written here as a run directory would hold it: reached 0.9 accuracy after
32,000 images at 32 images per update (1,000 updates), noise scale 8 there. Then
S_min = 1000 / (1 + 8/32) = 800 updates, and at 128 images per update 800 (1 + 8/128) = 850 updates,
108,800 images."""

import json
from dataclasses import replace

import pytest

from scaletrain.cli import main
from scaletrain.config import dump_toml, load_config
from scaletrain.perfmodel.profile import Profile, dump_profile
from scaletrain.perfmodel.recommend import recommend
from scaletrain.perfmodel.setup import ModelError
from scaletrain.perfmodel.statistical import Learning, read_learning

GB = 1_000_000_000
# One replica a node; compute 0.9 s + 0.1 s per 32 images; a network so fast it does not matter.
TOY = Profile(model="resnet8", image_size=16, batch_per_replica=32, gradient_bytes=1_000_000, replicas_per_node=1,
              compute_s=1.0, compute_base_s=0.9, optimizer_s=0.01, intra_bandwidth=1e12, intra_latency=0.0,
              net_bandwidth=1e12, net_latency=0.0, local_bandwidth=1e12, ps_apply_rate=1e12,
              device_memory=40 * GB, memory_base=GB, memory_per_image=GB // 10)
RECIPE = ["model.name=resnet8", "data.image_size=16", "data.batch_size=32", "cluster.gpus_per_node=1"]


def measured_run(tmp_path, noise=8.0, accuracy=(0.5, 0.9)):
    """A run of 2 replicas x 16 images (32 an update) that reached accuracy[1] at 32,000 images."""
    run = tmp_path / "measured"
    run.mkdir()
    (run / "config.toml").write_text(dump_toml(load_config(None, ["data.batch_size=16", "cluster.gpus_per_node=2"])))
    rows = [{"kind": "train", "step": s, "images": 32 * s, "loss": 1.0, "noise_scale": noise if s > 200 else 2 * noise}
            for s in range(100, 1300, 100)]
    rows += [{"kind": "eval", "step": 500, "images": 16000, "test_accuracy": accuracy[0]},
             {"kind": "eval", "step": 1000, "images": 32000, "test_accuracy": accuracy[1]}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "summary.json").write_text(json.dumps({"test_images": 1000}))
    return run


def emulator_run(tmp_path):
    """4 emulated asynchronous workers of 32 images (mean staleness 3) that reached 0.9 at 80,000 images:
    2,500 updates, 2.5x the 1,000 that synchronous updates of 32 took, so g = 2.5^(1/3) a version."""
    run = tmp_path / "emulated"
    run.mkdir()
    (run / "config.toml").write_text(dump_toml(load_config(None, ["data.batch_size=32", "strategy.emulate_workers=4"])))
    rows = [{"kind": "eval", "step": 2500, "images": 80000, "test_accuracy": 0.9}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "summary.json").write_text(json.dumps({"staleness_mean": 3.0, "test_images": 1000}))
    return run


def test_steps_at_another_update_follow_the_noise_scale_law(tmp_path):
    learning = read_learning(measured_run(tmp_path), ("accuracy", 0.9))
    assert (learning.images, learning.update, learning.noise_scale) == (32000, 32, 8.0)  # the noise scale there
    assert learning.updates_at(32) == pytest.approx(1000)
    assert learning.updates_at(128) == pytest.approx(850)
    assert learning.updates_at(10 ** 9) == pytest.approx(800)  # S_min: no update size goes below it


def test_time_to_accuracy_prefers_the_batch_that_needs_fewer_images(tmp_path):
    cfg = load_config(None, RECIPE)
    learning = Learning(("accuracy", 0.9), 32000, 32, 8.0, "toy")
    fast = recommend(cfg, TOY, max_nodes=1, progress=False, batches=[32, 128])[0]
    assert fast["best"]["batch_per_replica"] == 128  # by throughput: 128 / 1.31 s against 32 / 1.01 s
    [entry] = recommend(cfg, TOY, max_nodes=1, objective="time-to-accuracy", progress=False, batches=[32, 128],
                        learning=learning)
    best = entry["best"]
    assert best["batch_per_replica"] == 32
    assert best["target_images"] == pytest.approx(32000) and best["target_updates"] == pytest.approx(1000)
    assert best["target_hours"] == pytest.approx(32000 / best["images_per_sec"] / 3600, rel=1e-9)
    assert best["images_per_sec"] == pytest.approx(32 / 1.01, rel=0.02)
    assert "128: +1.7 min to the target (3.40x the images)" in entry["batch_reason"], entry["batch_reason"]
    with pytest.raises(ModelError, match="needs --learning"):
        recommend(cfg, TOY, max_nodes=1, objective="time-to-accuracy", progress=False)


def test_predict_until_from_a_run_directory(tmp_path, capsys):
    profile = tmp_path / "toy.toml"
    profile.write_text(dump_profile(replace(TOY, replicas_per_node=2), {}))
    run = measured_run(tmp_path)
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(dump_toml(load_config(None, [*RECIPE[:3], "cluster.gpus_per_node=2", "train.eval_every=100"])))
    args = ["predict", "--profile", str(profile), "--recipe", str(recipe), "--until", "accuracy=0.9", "--format",
            "json", "--grid", "strategy.name+cluster.num_ps=allreduce:0,sync:1,async:1,async-allreduce:0",
            "cluster.nodes=2", "--learning", str(run)]
    assert main(args) == 0
    rows = {r["strategy"]: r for r in json.loads(capsys.readouterr().out)}
    # 2 nodes x 2 replicas x 32: 128 images an update, allreduce and sync alike: 850 updates, 850 job steps;
    # 8 evaluations, each 1,000 test images over 4 replicas, 7.8 forwards of 32 at a third of 1.0 s: 20.8 s
    for name in ("allreduce", "sync"):
        assert rows[name]["target_updates"] == pytest.approx(850) and rows[name]["target_images"] == pytest.approx(108800)
        assert rows[name]["target_eval_hours"] * 3600 == pytest.approx(8 * 1000 / 4 / 32 / 3, rel=0.01)
        assert rows[name]["target_hours"] * 3600 == pytest.approx(108800 / rows[name]["images_per_sec"]
                                                                  + 8 * 1000 / 4 / 32 / 3, rel=0.01)
    assert "target_hours" not in rows["async"] and "emulator run" in rows["async"]["target_note"]
    assert "target_hours" not in rows["async-allreduce"] and "rounds" in rows["async-allreduce"]["target_note"]
    # with the emulator's run beside it, g = 2.5^(1/3): each replica's update of 32 images (async), a node's of 64
    # (mixed-async), at the staleness simulated for each
    grid = args.index("--grid") + 1
    args[grid] = "strategy.name+cluster.num_ps=async:1,mixed-async:1"
    emulated = str(emulator_run(tmp_path))
    assert main([*args, emulated]) == 0
    rows = {r["strategy"]: r for r in json.loads(capsys.readouterr().out)}
    for name, update in (("async", 32), ("mixed-async", 64)):
        tau = rows[name]["staleness_mean"]
        assert tau > 0 and rows[name]["target_updates"] == pytest.approx(800 * (1 + 8 / update) * 2.5 ** (tau / 3))
    # 4 nodes of 2 replicas pushing alone: staleness about 7, past the emulator's 3: not extrapolated
    args[args.index("cluster.nodes=2")] = "cluster.nodes=4"
    assert main([*args, emulated]) == 0
    row = json.loads(capsys.readouterr().out)[0]
    assert row["staleness_mean"] > 6 and "beyond the emulator runs' 3.0" in row["target_note"], row


@pytest.mark.parametrize("args, says", [
    (["--until", "accuracy=0.9"], "needs --until accuracy=A or loss=L and --learning RUN_DIR"),
    (["--until", "accuracy=0.99", "--learning", "RUN"], "the run never reached accuracy 0.99"),
    (["--until", "epochs=3", "--learning", "RUN"], "needs --until accuracy=A or loss=L"),
    (["--until", "speed=3"], "--until 'speed=3': write epochs=E, loss=L or accuracy=A"),
])
def test_what_cannot_be_predicted_is_one_line(tmp_path, capsys, args, says):
    profile = tmp_path / "toy.toml"
    profile.write_text(dump_profile(TOY, {}))
    run = measured_run(tmp_path)
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(dump_toml(load_config(None, RECIPE)))
    args = [str(run) if a == "RUN" else a for a in args]
    assert main(["predict", "--profile", str(profile), "--recipe", str(recipe), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1, err


def sync_run(path, batch, reached, noise=8.0):
    """A 1-replica synchronous run of `batch` images an update that reached accuracy 0.9 at `reached`
    images, with a measured noise scale `noise` on the way."""
    path.mkdir()
    (path / "config.toml").write_text(dump_toml(load_config(None, [f"data.batch_size={batch}"])))
    rows = [{"kind": "train", "step": 10, "images": 10 * batch, "loss": 1.0, "noise_scale": noise},
            {"kind": "eval", "step": reached // batch, "images": reached, "test_accuracy": 0.9}]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_runs_at_two_update_sizes_fit_the_critical_batch_the_runs_show(tmp_path):
    """S = 100 (1 + 32 / B): 300 updates at 16 images, 150 at 64, while the noise scale along the
    way read 8. The law fitted to the two runs predicts 125 updates at 128, where the first run and
    its noise scale alone would say 212.5 (S_min 300 / 1.5 = 200, times 1 + 8 / 128)."""
    runs = [sync_run(tmp_path / "b16", 16, 300 * 16), sync_run(tmp_path / "b64", 64, 150 * 64)]
    fit = read_learning(runs, ("accuracy", 0.9))
    assert fit.noise_scale == pytest.approx(32) and fit.fitted_updates == (16, 64)
    assert fit.updates_at(128) == pytest.approx(125) and fit.updates_at(16) == pytest.approx(300)
    assert "critical batch 32 fitted to runs at 16, 64" in fit.describe()
    one = read_learning(runs[:1], ("accuracy", 0.9))
    assert one.updates_at(128) == pytest.approx(300 / 1.5 * (1 + 8 / 128))  # the noise scale's reading
    # more images at the larger update and more updates too: no law of this form
    bad = [runs[0], sync_run(tmp_path / "worse", 64, 400 * 64)]
    with pytest.raises(ModelError, match="do not follow S = S_min"):
        read_learning(bad, ("accuracy", 0.9))
