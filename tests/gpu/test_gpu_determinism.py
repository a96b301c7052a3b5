"""train.deterministic on a GPU: the same run twice gives the same weights, bit for bit, and a
run stopped halfway and resumed ends with the weights of one that never stopped."""

import pytest

from .runs import differing

pytestmark = pytest.mark.gpu

DETERMINISTIC = ["train.device=cuda", "train.deterministic=true", "data.workers=1", "train.log_every=2",
                 "train.eval_every=0"]


@pytest.mark.parametrize("model,norm", [("resnet8", "group"), ("resnet18", "batch")])
def test_two_identical_deterministic_runs_are_bit_equal(train_run, model, norm):
    sets = [*DETERMINISTIC, f"model.name={model}", f"model.norm={norm}", "data.image_size=32",
            "data.batch_size=64", "data.augment=crop+flip", "train.steps=10"]
    a, b = train_run("a", *sets), train_run("b", *sets)
    assert differing(a.weights, b.weights) == []


def test_exact_resume_equals_an_uninterrupted_run(train_run):
    # As tests/unit/test_checkpoint.py on CPU: the schedule must not depend on train.steps, which the
    # first half changes to stop at step 6 (a cosine schedule would be stretched over 6 steps).
    sets = [*DETERMINISTIC, "model.name=resnet18", "model.norm=batch", "data.image_size=32", "data.batch_size=64",
            "data.augment=crop+flip", "optim.schedule=step", "optim.step_size=4", "optim.warmup_steps=3",
            "train.checkpoint_every=6", "train.steps=12"]
    straight = train_run("straight", *sets)
    half = train_run("resumed", *sets, "train.steps=6")
    resumed = train_run("resumed", *sets, resume=True)
    assert resumed.summary["start_step"] == 6 and resumed.summary["resumed_from"].endswith("ckpt-00000006.pt")
    assert resumed.summary["steps"] == straight.summary["steps"] == 12
    assert differing(straight.weights, resumed.weights) == []
    # and the comparison tells runs apart: the first half's weights are not the end's
    assert "fc.weight" in differing(straight.weights, half.weights)
