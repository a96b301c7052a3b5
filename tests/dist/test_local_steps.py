"""local-sgd and diloco with real processes and gloo on CPU: what they reduce to, the bytes they
send, and an exact resume with every replica's own optimizer state."""

import json
import shutil

import pytest
import torch

from test_strategies import EXACT, cluster, max_diff, run

SETUP = [*EXACT, "data.batch_size=8", "train.eval_every=0"]


def test_local_sgd_meeting_every_step_without_momentum_is_allreduce(tmp_path):
    """Each replica steps w - lr g_i, the meeting averages: w - lr mean(g), all-reduce's step."""
    _, allreduce = run(tmp_path, "allreduce", *SETUP, "optim.momentum=0", *cluster(2, 2))
    _, local = run(tmp_path, "local", *SETUP, "optim.momentum=0", *cluster(2, 2, 0, "local-sgd", "strategy.sync_every=1"))
    assert max_diff(allreduce, local) <= 1e-5


def test_diloco_with_a_plain_outer_step_is_local_sgd(tmp_path):
    """The anchor minus the mean change, at outer_lr 1 without momentum, is the mean of the weights."""
    sets = [*SETUP, "optim.momentum=0.9", "train.steps=6"]
    _, local = run(tmp_path, "local", *sets, *cluster(2, 1, 0, "local-sgd", "strategy.sync_every=2"))
    _, plain = run(tmp_path, "plain", *sets, *cluster(2, 1, 0, "diloco", "strategy.sync_every=2",
                                                          "strategy.outer_lr=1", "strategy.outer_momentum=0"))
    _, diloco = run(tmp_path, "diloco", *sets, *cluster(2, 1, 0, "diloco", "strategy.sync_every=2"))
    assert max_diff(local, plain) <= 1e-5
    assert max_diff(local, diloco) > 1e-3  # Nesterov at 0.5, momentum 0.8: another path


@pytest.mark.parametrize("name", ["local-sgd", "diloco"])
def test_local_steps_resume_is_exact(tmp_path, name):
    """Checkpoints every 4 steps wait for the meetings every 3: they fall at steps 6, 9 and 12, not 4 and 8.
    Resumed from step 6's, each replica's own momentum comes back from the checkpoint (replica_state),
    diloco's outer momentum too, and the meetings fall on the same steps: the weights of the run straight."""
    sets = [*SETUP, "optim.momentum=0.9", "train.steps=12", "train.checkpoint_every=4", "train.keep_checkpoints=5",
            *cluster(2, 1, 0, name, "strategy.sync_every=3")]
    _, straight = run(tmp_path, "straight", *sets)
    ckpts = sorted((tmp_path / "straight" / "checkpoints").glob("ckpt-*.pt"))
    assert [int(c.stem.split("-")[1]) for c in ckpts] == [6, 9, 12]
    ckpt = torch.load(ckpts[0], weights_only=True)
    assert len(ckpt["replica_buffers"]) == 2 and not torch.equal(*ckpt["replica_buffers"])  # two momenta
    assert ("outer" in ckpt) == (name == "diloco")
    split = tmp_path / "split"
    shutil.copytree(tmp_path / "straight", split)
    for c in ckpts[1:]:
        (split / "checkpoints" / c.name).unlink()
    s, resumed = run(tmp_path, "split", *sets, resume=True)
    assert s["start_step"] == 6 and s["steps"] == 12
    assert max_diff(straight, resumed) <= 1e-5


def test_local_steps_reach_allreduces_accuracy_with_an_eighth_of_its_bytes(tmp_path):
    """The study of 4 replicas on digits, 16 epochs each (equal images), sync_every 8: local-sgd and
    diloco end within 1 point of all-reduce's test accuracy and send 1/8 of its bytes a step."""
    from scaletrain.cli import main

    from conftest import RECIPES
    sets = ["data.workers=0", "cluster.nodes=2", "cluster.gpus_per_node=2", "data.batch_size=16",
            "optim.scale_lr=linear", "optim.reference_batch=32", "optim.warmup_steps=5", "train.steps=0",
            "train.eval_every=0", "train.checkpoint_every=0"]
    args = ["study", "--recipe", str(RECIPES / "digits.toml"), *(a for s in sets for a in ("--set", s)),
            "--grid", "strategy.name=allreduce,local-sgd,diloco", "--until", "epochs=16", "--out", str(tmp_path)]
    assert main(args) == 0
    rows = {r["cell"]["strategy.name"]: r for r in map(json.loads, (tmp_path / "study.jsonl").read_text().splitlines())}
    base = rows["allreduce"]
    assert base["test_accuracy"] > 0.95
    for name in ("local-sgd", "diloco"):
        r = rows[name]
        assert r["images_applied"] == base["images_applied"]
        assert r["test_accuracy"] >= base["test_accuracy"] - 0.01, (name, r["test_accuracy"], base["test_accuracy"])
        assert r["bytes_per_step"]["worker_sent"] == pytest.approx(base["bytes_per_step"]["worker_sent"] / 8, rel=1e-6)
        assert r["staleness_mean"] == pytest.approx(3.5)  # steps 0..7 after a meeting, as many of each
    assert "local-sgd" in (tmp_path / "study.md").read_text()
