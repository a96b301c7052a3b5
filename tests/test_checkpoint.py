import pytest
import torch
from safetensors.torch import load_file

from scaletrain import checkpoint
from scaletrain.checkpoint import CheckpointError
from scaletrain.train import RunError, train


def test_crash_between_write_and_rename_keeps_previous(tmp_path, monkeypatch):
    d = tmp_path / "ckpt"
    checkpoint.save(d, 10, {"step": 10, "w": torch.ones(3)}, keep=2)

    def crash(*_):
        raise OSError("power cut")

    monkeypatch.setattr(checkpoint.os, "replace", crash)
    with pytest.raises(OSError):
        checkpoint.save(d, 20, {"step": 20, "w": torch.zeros(3)}, keep=2)
    monkeypatch.undo()
    assert (d / "ckpt-00000020.pt.tmp").exists()  # the half-done write is there...
    state, path = checkpoint.load_latest(d)  # ...and is never what gets loaded
    assert state["step"] == 10 and path.name == "ckpt-00000010.pt"


def test_unreadable_newest_falls_back_and_keep_prunes(tmp_path):
    d = tmp_path / "ckpt"
    for s in (1, 2, 3):
        checkpoint.save(d, s, {"step": s}, keep=2)
    assert [s for s, _ in checkpoint.list_complete(d)] == [2, 3]
    (d / "ckpt-00000003.pt").write_bytes(b"garbage")
    assert checkpoint.load_latest(d)[0]["step"] == 2


def test_exact_resume_equals_straight_run(digits_cfg, tmp_path):
    # The schedule must not depend on train.steps, which the first half changes
    # to stop at step 6 (a cosine schedule would be stretched over 6 steps).
    cfg = digits_cfg("train.steps=12", "train.deterministic=true", "data.augment=crop+flip",
                     "optim.schedule=step", "optim.step_size=4", "optim.warmup_steps=3",
                     "train.checkpoint_every=6", "data.workers=1")
    train(cfg, tmp_path / "straight", progress=False)
    train(cfg.replace(**{"train.steps": 6}), tmp_path / "resumed", progress=False)
    s = train(cfg, tmp_path / "resumed", resume=True, progress=False)
    assert s["start_step"] == 6 and s["resumed_from"].endswith("ckpt-00000006.pt")
    a = load_file(str(tmp_path / "straight" / "model.safetensors"))
    b = load_file(str(tmp_path / "resumed" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # and the comparison can tell runs apart: a different seed differs
    train(cfg.replace(**{"train.seed": 1}), tmp_path / "other", progress=False)
    c = load_file(str(tmp_path / "other" / "model.safetensors"))
    assert not torch.equal(a["fc.weight"], c["fc.weight"])


def test_resume_without_checkpoint_starts_fresh(digits_cfg, tmp_path):
    s = train(digits_cfg("train.steps=2"), tmp_path / "r", resume=True, progress=False)
    assert s["start_step"] == 0 and s["resumed_from"] is None


def test_incompatible_checkpoint_refused_naming_keys(digits_cfg, tmp_path):
    train(digits_cfg("train.steps=2"), tmp_path / "r", progress=False)
    with pytest.raises(CheckpointError, match=r"differing keys: model\.width \(16 -> 8\), optim\.lr"):
        train(digits_cfg("train.steps=4", "model.width=8", "optim.lr=0.2"), tmp_path / "r", resume=True,
              progress=False)
    with pytest.raises(RunError, match="pass --resume"):
        train(digits_cfg("train.steps=2"), tmp_path / "r", progress=False)
