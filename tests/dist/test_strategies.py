"""Every strategy with real processes and gloo on CPU, against single-process references."""

import json
import re

import pytest
import torch
from safetensors.torch import load_file

from scaletrain.cli import main
from scaletrain.config import load_config
from scaletrain.models import build_model

from conftest import RECIPES

EXACT = ["model.norm=group", "optim.name=sgd", "optim.weight_decay=1e-4", "optim.schedule=constant",
         "optim.warmup_steps=0", "data.augment=none", "train.deterministic=true", "train.steps=5",
         "data.workers=0", "train.log_every=1", "train.warmup_log_steps=0"]


def run(tmp_path, name, *overrides, resume=False):
    run_dir = tmp_path / name
    args = ["train", "--recipe", str(RECIPES / "digits.toml"), "--run-dir", str(run_dir), "--quiet",
            *(["--resume"] if resume else [])]
    for o in overrides:
        args += ["--set", o]
    assert main(args) == 0, (run_dir / "logs").exists() and sorted((run_dir / "logs").glob("*.log"))
    return json.loads((run_dir / "summary.json").read_text()), load_file(str(run_dir / "model.safetensors"))


def max_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


def cluster(nodes, gpus, ps=0, strategy="allreduce", *more):
    return [f"cluster.nodes={nodes}", f"cluster.gpus_per_node={gpus}", f"cluster.num_ps={ps}",
            f"strategy.name={strategy}", *more]


def test_every_name_of_the_traits_table_builds_a_strategy():
    """traits.REGISTRY names the strategies; build.CLASSES, the only map from a name to code, covers it."""
    from scaletrain.strategies.build import CLASSES
    from scaletrain.strategies.traits import REGISTRY

    assert set(CLASSES) == set(REGISTRY)


def test_strategies_equal_single_process_exactly(tmp_path):
    b = 8
    _, single = run(tmp_path, "single", *EXACT, f"data.batch_size={4 * b}")
    s_sync, sync = run(tmp_path, "sync", *EXACT, f"data.batch_size={b}", *cluster(2, 2, 1, "sync"))
    _, allreduce = run(tmp_path, "allreduce", *EXACT, f"data.batch_size={b}", *cluster(2, 2))
    assert s_sync["replicas"] == 4 and s_sync["num_ps"] == 1 and s_sync["staleness_max"] == 0
    assert max_diff(single, sync) <= 1e-5
    assert max_diff(single, allreduce) <= 1e-5
    _, three_ps = run(tmp_path, "sync3", *EXACT, f"data.batch_size={b}",
                      *cluster(2, 2, 3, "sync", "cluster.ps_placement=dedicated", "cluster.sharding=round-robin"))
    _, backup0 = run(tmp_path, "backup0", *EXACT, f"data.batch_size={b}", *cluster(2, 2, 1, "backup"))
    assert max_diff(sync, three_ps) <= 1e-5
    assert max_diff(sync, backup0) <= 1e-5
    # and the comparison can fail: one more step is a different model
    _, longer = run(tmp_path, "longer", *EXACT, "train.steps=6", f"data.batch_size={4 * b}")
    assert max_diff(single, longer) > 1e-4


def test_mixed_async_on_one_node_equals_sync(tmp_path):
    b = 8
    _, sync = run(tmp_path, "sync", *EXACT, f"data.batch_size={b}", *cluster(1, 2, 1, "sync"))
    s, mixed = run(tmp_path, "mixed", *EXACT, f"data.batch_size={b}", *cluster(1, 2, 1, "mixed-async"))
    assert s["staleness_mean"] == 0
    assert max_diff(sync, mixed) <= 1e-5


def test_mixed_async_accuracy(tmp_path):
    s, _ = run(tmp_path, "equal", *cluster(4, 1, 1, "mixed-async"), "data.workers=0", "train.eval_every=0")
    assert s["staleness_max"] > 0 and s["test_accuracy"] >= 0.85


def test_mixed_async_staleness_is_the_other_nodes_updates(tmp_path):
    """4 nodes of equal speed (emulated compute, so that the cores' scheduling hardly matters): between
    a node's pull and its push the 3 others each push once, so most gradients are exactly 3 updates
    stale (the first round's are 0-3). Counting one's own update, or none, would make the mode 4 or 0."""
    s, _ = run(tmp_path, "equal", *cluster(4, 1, 1, "mixed-async"), "data.workers=0", "train.eval_every=0",
               "train.emulate_compute_s=0.05", "train.steps=60", "train.checkpoint_every=0")
    hist = s["staleness_hist"]
    assert hist.index(max(hist)) == 3 and hist[3] > sum(hist) / 2, hist
    assert 2.5 <= s["staleness_mean"] <= 3.5, hist


def test_slow_node_is_staler_and_does_not_hold_others_back(tmp_path):
    s, _ = run(tmp_path, "slow", *cluster(4, 1, 1, "mixed-async", "strategy.slow_node=3",
                                          "strategy.slow_delay_s=0.3"), "data.workers=0", "train.steps=80",
               "train.eval_every=0")
    by_node = {w["node"]: w for w in s["per_worker"]}
    fast = [by_node[n] for n in (0, 1, 2)]
    assert by_node[3]["staleness_mean"] > max(w["staleness_mean"] for w in fast)
    # per process: the images each computed over its own time
    assert min(w["computed_images_per_sec"] for w in fast) > 2 * by_node[3]["computed_images_per_sec"]


def test_traffic_per_node(tmp_path):
    common = ["data.workers=0", "train.steps=10", "train.eval_every=0"]
    mixed, _ = run(tmp_path, "mixed", *cluster(2, 2, 1, "mixed-async"), *common)
    asyn, _ = run(tmp_path, "async", *cluster(2, 2, 2, "async", "cluster.sharding=round-robin"), *common)
    grad_bytes = mixed["parameters"] * 4
    assert mixed["ps_bytes_per_node_step"] == pytest.approx(2 * grad_bytes, rel=0.02)
    assert asyn["ps_bytes_per_node_step"] / mixed["ps_bytes_per_node_step"] == pytest.approx(2, rel=0.02)
    # round-robin over 2 shards: tensor i to shard i % 2, so resnet8's split is uneven; the traffic the
    # shards counted carries that layout's imbalance, worked out here from the network's tensors
    numels = [p.numel() for p in build_model(load_config(RECIPES / "digits.toml").model).parameters()]
    layout = [sum(n for i, n in enumerate(numels) if i % 2 == k) for k in (0, 1)]
    assert asyn["shard_bytes"]["max_over_mean"] == pytest.approx(max(layout) * 2 / sum(layout), rel=1e-6)
    assert asyn["shard_traffic"]["max_over_mean"] == pytest.approx(max(layout) * 2 / sum(layout), rel=0.02)


@pytest.mark.parametrize("shape, half", [((2, 1, 0, "allreduce"), "fp16"), ((2, 1, 1, "sync"), "bf16")])
def test_compression_halves_the_bytes_and_keeps_the_accuracy(tmp_path, shape, half):
    """strategy.compression: gradients (and a PS's values) cross between nodes in a half type."""
    common = [*cluster(*shape), "data.workers=0", "train.eval_every=0", "train.checkpoint_every=0",
              "model.norm=group", "data.augment=none", "train.deterministic=true"]  # runs differ by the wire only
    full, full_weights = run(tmp_path, "fp32", *common)
    small, small_weights = run(tmp_path, half, *common, f"strategy.compression={half}")
    key = "ps_bytes_per_node_step" if shape[2] else "bytes_per_step"
    sent = (lambda s: s[key]) if shape[2] else (lambda s: s[key]["worker_sent"])
    assert sent(small) == pytest.approx(sent(full) / 2, rel=1e-3)  # counted from the tensors sent
    assert max_diff(small_weights, full_weights) > 0  # the half type rounded what crossed: the wire was used
    assert full["test_accuracy"] > 0.9 and abs(small["test_accuracy"] - full["test_accuracy"]) <= 0.01


@pytest.mark.parametrize("overrides, pattern", [
    (cluster(2, 1, 0, "async-allreduce", "strategy.compression=fp16"), r"strategy\.compression = fp16: acts between"),
    (cluster(2, 1, 3, "sync"), r"cluster\.num_ps = 3 > cluster\.nodes = 2"),
    (cluster(2, 1, 0, "sync"), r"needs at least one parameter server"),
    (cluster(2, 1, 1, "allreduce"), r"uses no parameter server"),
    (cluster(2, 1, 1, "backup", "strategy.backup_workers=2"), r"strategy\.backup_workers = 2: must be below"),
])
def test_invalid_cluster_fails_before_start(tmp_path, capsys, overrides, pattern):
    args = ["train", "--recipe", str(RECIPES / "digits.toml"), "--run-dir", str(tmp_path / "r")]
    for o in overrides:
        args += ["--set", o]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(pattern, err[0]), err
    assert not (tmp_path / "r" / "logs").exists()


def latest_checkpoint(run_dir):
    return torch.load(sorted((run_dir / "checkpoints").glob("ckpt-*.pt"))[-1], weights_only=True)


@pytest.mark.parametrize("shape", [cluster(2, 2, 2, "sync"), cluster(1, 2, 1, "mixed-async")],
                         ids=["sync-2x2-2ps", "mixed-async-1x2"])
def test_ps_resume_is_exact(tmp_path, shape):
    """Momentum and versions live on the PS shards: a resume that lost either would not match."""
    setup = [*EXACT, "optim.momentum=0.9", "data.batch_size=8", *shape]
    shards = int(shape[2].split("=")[1])
    _, straight = run(tmp_path, "straight", *setup, "train.steps=10")
    run(tmp_path, "split", *setup, "train.steps=5")
    ckpt = latest_checkpoint(tmp_path / "split")
    assert [s["version"] for s in ckpt["ps"]] == [5] * shards
    assert all(s["optimizer"]["momentum_buffer"].abs().sum() > 0 for s in ckpt["ps"])
    s, resumed = run(tmp_path, "split", *setup, "train.steps=10", resume=True)
    assert s["start_step"] == 5 and s["steps"] == 10
    assert max_diff(straight, resumed) <= 1e-5
    assert [s["version"] for s in latest_checkpoint(tmp_path / "split")["ps"]] == [10] * shards


def test_async_resume_carries_versions(tmp_path):
    setup = [*cluster(2, 1, 1, "mixed-async"), "data.workers=0", "train.eval_every=0"]
    run(tmp_path, "r", *setup, "train.steps=30")
    v1 = latest_checkpoint(tmp_path / "r")["ps"][0]["version"]
    assert 30 <= v1 <= 60  # the chief's 30 pushes, and some or all of the other node's
    s, _ = run(tmp_path, "r", *setup, "train.steps=40", resume=True)
    assert s["start_step"] == 30
    # With the versions restored, a push is at most the other node's 10 new pushes stale;
    # a worker that restarted counting from 0 would see staleness >= v1.
    assert s["staleness_max"] <= 10, s["staleness_hist"]
    assert latest_checkpoint(tmp_path / "r")["ps"][0]["version"] >= v1 + 10


# --- async-allreduce ---------------------------------------------------------------------------

def test_async_allreduce_bound_1_is_sgd_with_gradients_one_update_stale(tmp_path):
    """Each replica waits for a round once it has computed one gradient since it began: every update
    averages one gradient of each replica, computed one update earlier. The one-process emulator of
    2 asynchronous workers applies exactly that (each gradient on the values one update back)."""
    b = 8
    _, emulated = run(tmp_path, "emulated", *EXACT, f"data.batch_size={4 * b}", "strategy.emulate_workers=2")
    s, asy = run(tmp_path, "async", *EXACT, f"data.batch_size={b}",
                 *cluster(2, 2, 0, "async-allreduce", "strategy.async_bound=1"))
    assert max_diff(emulated, asy) <= 1e-5
    assert s["gradients_per_update_hist"] == [0, 0, 0, 0, 5]  # 5 updates of the 4 replicas' gradients
    assert s["staleness_hist"] == [4, 16] and s["staleness_mean"] == pytest.approx(0.8)
    _, allreduce = run(tmp_path, "allreduce", *EXACT, f"data.batch_size={b}", *cluster(2, 2))
    assert max_diff(allreduce, asy) > 1e-4  # stale gradients: not all-reduce


def test_async_allreduce_replicas_do_not_wait_for_slow_communication(tmp_path):
    """ResNet-18's 45 MB gradient takes longer to all-reduce between 2 replicas than a 5 ms
    emulated step: the replicas keep stepping, and each update averages several of their gradients."""
    s, _ = run(tmp_path, "slowcomm", *cluster(1, 2, 0, "async-allreduce"), "model.name=resnet18",
               "data.image_size=32", "train.emulate_compute_s=0.005", "train.steps=20", "train.eval_every=0",
               "data.workers=0", "train.checkpoint_every=0")
    updates = sum(s["gradients_per_update_hist"])
    steps = [w["steps"] for w in s["per_worker"]]
    assert s["gradients_per_update_mean"] > 3, s["gradients_per_update_hist"]  # more than one per replica
    assert min(steps) > 1.5 * updates, (steps, updates)  # the replicas stepped faster than the rounds
    # A gradient goes in the round after the one in flight as it is computed: one update stale,
    # but for the first round's (no update before it)
    assert s["staleness_max"] == 1 and 0 < s["staleness_hist"][0] < s["staleness_hist"][1], s["staleness_hist"]
    # every applied gradient's staleness is counted
    assert sum(s["staleness_hist"]) == sum(i * c for i, c in enumerate(s["gradients_per_update_hist"]))
    assert main(["report", str(tmp_path / "slowcomm"), "--out", str(tmp_path / "report")]) == 0
    html = (tmp_path / "report" / "report.html").read_text()
    assert "Gradients averaged by each update" in html and "Staleness of applied gradients" in html
    assert (tmp_path / "report" / "gradients-per-update.png").stat().st_size > 0


def test_compiled_allreduce_trains_as_eager(tmp_path):
    """train.compile: torch.compile around the module backward runs through (DDP under allreduce)."""
    sets = [*EXACT, "data.batch_size=8", *cluster(1, 2)]
    s, eager = run(tmp_path, "eager", *sets)
    s_c, compiled = run(tmp_path, "compiled", *sets, "train.compile=true")
    assert s_c["steps"] == s["steps"] == 5
    assert max_diff(eager, compiled) <= 1e-4  # the same training, up to the order of float sums
