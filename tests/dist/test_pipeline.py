"""Pipeline stages (parallel.stages) with real processes and gloo, against one process on the same global batch."""

import json
import subprocess
import sys

import pytest
import torch

from test_strategies import EXACT, latest_checkpoint, max_diff, run

from scaletrain.cli import main

from conftest import RECIPES, ROOT
from p2p_spy import pairs_used

BATCH = 32
# resnet8 on digits: the layers stem, layer1.0, layer2.0, layer3.0, fc; momentum and decay make the
# optimizer's state and every stage's decay part of what must match
SETUP = [*EXACT, "model.name=resnet8", "optim.momentum=0.9", "parallel.microbatches=4"]


def staged(stages, replicas, *more):
    return [f"parallel.stages={stages}", f"cluster.gpus_per_node={stages * replicas}",
            f"data.batch_size={BATCH // replicas}", *more]


def test_stages_equal_one_process(tmp_path):
    """S = 2 and 4 stages, GPipe and 1F1B, one and two replicas: the weights of one process after 5 steps."""
    _, single = run(tmp_path, "single", *SETUP, f"data.batch_size={BATCH}")
    s2, two = run(tmp_path, "s2", *SETUP, *staged(2, 1, "parallel.schedule=gpipe"))
    _, four = run(tmp_path, "s4", *SETUP, *staged(4, 1))
    s22, two_by_two = run(tmp_path, "s2r2", *SETUP, *staged(2, 2))
    assert set(two) == set(single)  # one logical model: the whole network's names
    for got in (two, four, two_by_two):
        assert max_diff(single, got) <= 1e-5
    assert s2["stages"] == 2 and s2["replicas"] == 1 and s22["replicas"] == 2
    assert s22["images_applied"] == s22["images_computed"] == 5 * BATCH  # a replica's batch counted once, not a stage
    assert all(w["computed_images_per_sec"] > 0 for w in s22["per_worker"])
    stages = s22["pipeline"]["stages"]
    assert [s["first"] for s in stages][0] == "stem" and stages[-1]["last"] == "fc"
    assert all(0 <= s["idle_fraction"] < 1 for s in stages)
    # stage 1 sends each micro-batch's activations, stage 2 their gradients back: the same bytes
    assert stages[0]["activation_bytes_per_step"] == stages[1]["activation_bytes_per_step"] > 0
    # and the comparison can fail: a sixth step is another model
    _, longer = run(tmp_path, "longer", *SETUP, f"data.batch_size={BATCH}", "train.steps=6")
    assert max_diff(single, longer) > 1e-4


def test_stages_resume_is_exact(tmp_path):
    """A checkpoint of staged replicas holds one model and one optimizer state; resumed, the run goes on as
    one that never stopped (with BatchNorm: each replica's statistics come back to each stage)."""
    setup = [*SETUP, "model.norm=batch", *staged(2, 2), "train.checkpoint_every=3"]
    _, straight = run(tmp_path, "straight", *setup, "train.steps=6")
    run(tmp_path, "split", *setup, "train.steps=3")
    ckpt = latest_checkpoint(tmp_path / "split")
    from scaletrain.models.resnet import resnet
    assert set(ckpt["model"]) == set(resnet("resnet8", 10, "batch").state_dict())  # the whole network's names
    params = len(ckpt["optimizer"]["param_groups"][0]["params"])
    assert sorted(ckpt["optimizer"]["state"]) == list(range(params))  # every stage's momentum
    assert len(ckpt["replica_buffers"]) == 2 and len(ckpt["replica_buffers"][0]) == 2  # [stage][replica]
    s, resumed = run(tmp_path, "split", *setup, "train.steps=6", resume=True)
    assert s["start_step"] == 3 and s["steps"] == 6
    assert max_diff(straight, resumed) <= 1e-5


@pytest.mark.parametrize("overrides, pattern", [
    (["parallel.stages=2", "cluster.gpus_per_node=3"], "cluster.gpus_per_node = 3: .*multiple of 2"),
    (["parallel.stages=2", "cluster.gpus_per_node=2", "strategy.name=async-allreduce"],
     "parallel.stages = 2: composes with strategy.name = allreduce or sync; not 'async-allreduce'"),
    (["parallel.stages=2", "cluster.gpus_per_node=2", "parallel.split=['layer9.0']"],
     "parallel.split: no layer 'layer9.0'; the layers are stem, layer1.0"),
])
def test_bad_stage_settings_fail_in_one_line(tmp_path, capfd, overrides, pattern):
    args = ["train", "--recipe", str(RECIPES / "digits.toml"), "--run-dir", str(tmp_path / "r"), "--quiet",
            "--set", "data.workers=0", "--set", "model.name=resnet8"]
    for o in overrides:
        args += ["--set", o]
    assert main(args) != 0
    err = capfd.readouterr().err.strip().splitlines()
    assert any(__import__("re").search(pattern, line) for line in err), err
    assert not any("Traceback" in line for line in err)


def test_a_loop_of_ones_own_with_stages(tmp_path):
    """examples/custom_loop.py with one replica of 2 stages and BatchNorm (each stage evaluates with its own
    statistics), started by the script itself (the local launcher): its loop gives each batch to
    job.forward_backward."""
    import subprocess
    import sys

    from conftest import ROOT
    run_dir = tmp_path / "mine"
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "custom_loop.py"), "--recipe",
                           str(RECIPES / "digits.toml"), "--run-dir", str(run_dir),
                           *[a for o in ("parallel.stages=2", "cluster.gpus_per_node=2", "train.steps=30",
                                         "data.workers=0", "model.name=resnet8") for a in ("--set", o)]],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    s = json.loads((run_dir / "summary.json").read_text())
    assert (s["stages"], s["replicas"], s["steps"], s["images_applied"]) == (2, 1, 30, 30 * 32)
    assert s["test_accuracy"] > 0.15  # above chance (10 classes): it learns


def test_the_wrapped_module_of_stages_is_not_called():
    from scaletrain.errors import RunError
    from scaletrain.pipeline import Stages
    with pytest.raises(RunError, match=r"write loss = job.forward_backward\(x, y\)"):
        Stages(torch.nn.Linear(2, 2))(torch.zeros(1, 2))


def test_stages_under_a_sync_parameter_server_equal_one_process(tmp_path):
    """2 nodes of one replica in 2 stages with 2 PS shards (one a stage), and 4 stages with 4: each stage pushes
    its own parameters' gradient to its shards; the weights of one process on the same batch. Resumed, exact."""
    setup = [*SETUP, "strategy.name=sync", "cluster.nodes=2", "cluster.num_ps=2", *staged(2, 1),
             f"data.batch_size={BATCH // 2}"]
    _, single = run(tmp_path, "single", *SETUP, f"data.batch_size={BATCH}")
    s, ps = run(tmp_path, "sync", *setup)
    assert (s["stages"], s["replicas"], s["num_ps"]) == (2, 2, 2)
    assert max_diff(single, ps) <= 1e-5
    run(tmp_path, "split", *setup, "train.steps=3")
    ckpt = latest_checkpoint(tmp_path / "split")
    assert [x["version"] for x in ckpt["ps"]] == [3, 3] and all(x["optimizer"] for x in ckpt["ps"])
    s, resumed = run(tmp_path, "split", *setup, resume=True)
    assert s["start_step"] == 3 and max_diff(single, resumed) <= 1e-5
    # 4 stages of one replica, a dedicated PS node a stage
    _, four = run(tmp_path, "sync4", *SETUP, "strategy.name=sync", "cluster.num_ps=4", "cluster.ps_placement=dedicated",
                  *staged(4, 1))
    assert max_diff(single, four) <= 1e-5


def test_every_pair_evaluation_and_checkpoints_use_is_warmed_at_start_up(tmp_path):
    """Under NCCL a pair's first single send builds its communicator: each pair that evaluation and the
    checkpoints use later has exchanged at start-up, so that one that cannot talk fails there."""
    run_dir = tmp_path / "run"
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "p2p_spy.py"), str(RECIPES / "digits.toml"), str(run_dir),
                        "parallel.stages=3", "cluster.gpus_per_node=3", "train.threads=1", "cluster.timeout_s=30"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    for rank in range(3):
        used = pairs_used(run_dir, rank)
        assert used["after"] and used["after"] <= used["start"], (rank, used)
    # the last stage: evaluation's activations from stage 2 (and the schedule's first step, whose vote
    # torch's pipelining sends by single sends to the neighbours), and the gather into stage 1
    assert pairs_used(run_dir, 2)["after"] == {frozenset((1, 2)), frozenset((2, 0))}
