"""The reference case on a GPU: ResNet-50 at 224 px with bf16 autocast and channels_last,
compiled and eager, a few steps of synthetic data through the study's recipe."""

import pytest

from scaletrain import checkpoint

from .runs import ROOT

pytestmark = pytest.mark.gpu

RESNET50 = ROOT / "recipes" / "anp-resnet50.toml"
STEPS = 8
SETS = ["model.init_from=", "data.name=synthetic", "data.synthetic_size=1024", "data.augment=none",
        "data.image_size=224", "data.batch_size=32", "data.workers=2", "train.device=cuda",
        "train.precision=bf16", "train.channels_last=true", f"train.steps={STEPS}", "train.log_every=1",
        "train.warmup_log_steps=3", "train.eval_every=0", "train.checkpoint_every=4"]


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "eager"])
def test_resnet50_bf16_channels_last_trains_and_checkpoints(train_run, gpu_name, compiled):
    run = train_run("resnet50", *SETS, f"train.compile={str(compiled).lower()}", recipe=RESNET50)
    s = run.summary
    assert s["device"] == gpu_name
    assert s["not_applied"] == {}  # bf16 and channels_last took effect
    assert s["images_per_sec"] > 0 and s["timed_windows"] > 0
    assert s["steps"] == STEPS and s["model"] == "resnet50"
    assert s["final_train_loss"] == s["final_train_loss"]  # not NaN
    saved = checkpoint.list_complete(run.run_dir / "checkpoints")
    assert [step for step, _ in saved] == [4, STEPS], saved
    state = checkpoint.read(saved[-1][1])
    assert state["step"] == STEPS and state["model"].keys() == run.weights.keys()
