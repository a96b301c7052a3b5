"""Label smoothing, mixup and CutMix (mixing.py): the mixed pixels come from the two sources in the
proportion the soft target says, the draws are a pure function of (seed, step, replica), the loss of
soft targets is cross-entropy against probabilities, and the noise scale's half batch trains toward
the same soft targets as the whole batch."""

import json
import subprocess

import pytest
import torch
import torch.nn.functional as F

import scaletrain
from scaletrain.config import ConfigError
from scaletrain.job import Job
from scaletrain.mixing import Draw, Mixer, draw, mix, partners, soft_targets
from scaletrain.noise import squared_norm
from scaletrain.optim import loss_fn

from conftest import RECIPES, scaletrain_cmd

N, C, H, W = 8, 10, 12, 12


def labelled_images(n=N):
    """Image i filled with the value i and labelled class i: each pixel names its source."""
    x = torch.arange(n, dtype=torch.float32).view(n, 1, 1, 1).expand(n, 3, H, W).clone()
    return x, torch.arange(n)


def test_partners_pair_within_each_half():
    p = partners(N)
    assert p.tolist() == [3, 2, 1, 0, 7, 6, 5, 4] and torch.equal(p[p], torch.arange(N))
    assert partners(5).tolist() == [1, 0, 4, 3, 2] and partners(1).tolist() == [0]


def test_mixup_blends_pixels_and_targets_by_lambda():
    x, y = labelled_images()
    mixed, target = mix(x.clone(), y, C, Draw("mixup", 0.3))
    p = partners(N)
    assert torch.allclose(mixed, 0.3 * x + 0.7 * x[p])
    for i in range(N):  # the pixel value says the share: 0.3 i + 0.7 p(i)
        assert target[i, i] == pytest.approx(0.3) and target[i, p[i]] == pytest.approx(0.7)
    assert torch.allclose(target.sum(1), torch.ones(N))


@pytest.mark.parametrize("step", range(6))
def test_cutmix_pixels_come_from_the_sources_in_the_targets_share(step):
    d = draw(0.0, 1.0, seed=3, step=step, replica=0, height=H, width=W)
    assert d.kind == "cutmix"
    x, y = labelled_images()
    mixed, target = mix(x.clone(), y, C, d)
    p = partners(N)
    for i in range(N):
        own = (mixed[i] == i).float().mean().item()  # the share of the image's pixels still its own
        assert (mixed[i] == p[i]).float().mean().item() == pytest.approx(1 - own)
        assert target[i, i].item() == pytest.approx(own) and target[i, p[i]].item() == pytest.approx(1 - own)
        assert own == pytest.approx(d.lam)


def test_cutmix_box_is_clipped_and_lambda_corrected():
    """Boxes near an edge are cut by it: lambda is the share left outside the clipped box, not the draw."""
    boxes = [draw(0.0, 1.0, 0, step, 0, H, W) for step in range(200)]
    assert any(b.box[0] == 0 or b.box[1] == H or b.box[2] == 0 or b.box[3] == W for b in boxes)
    for b in boxes:
        top, bottom, left, right = b.box
        assert 0 <= top <= bottom <= H and 0 <= left <= right <= W
        assert b.lam == pytest.approx(1 - (bottom - top) * (right - left) / (H * W))


def test_draws_are_a_pure_function_of_seed_step_and_replica():
    args = dict(mixup_alpha=0.4, cutmix_alpha=1.0, height=H, width=W)
    first = [draw(seed=1, step=s, replica=r, **args) for s in range(20) for r in range(3)]
    assert first == [draw(seed=1, step=s, replica=r, **args) for s in range(20) for r in range(3)]
    lams = {draw(0.4, 0.0, 1, s, r, H, W).lam for s in range(20) for r in range(3)}
    assert len(lams) == 60  # every step and replica mixes differently (a box on 12 x 12 pixels may repeat)
    assert draw(seed=2, step=0, replica=0, **args) != first[0]
    assert {d.kind for d in first} == {"mixup", "cutmix"}  # both on: each batch takes one
    assert draw(0.0, 0.0, 1, 0, 0, H, W) == Draw("none")


def test_a_mixer_mixes_a_batch_alike_whenever_asked(digits_cfg):
    """A resumed run (or another stage of the replica) mixes step s's batch as the first run did."""
    cfg = digits_cfg("data.mixup_alpha=0.2", "data.cutmix_alpha=1.0", "train.label_smoothing=0.1")
    x = torch.randn(N, 3, H, W)
    y = torch.randint(0, C, (N,))
    a = Mixer(cfg, replica=1)((x.clone(), y), step=7)
    b = Mixer(cfg, replica=1)((x.clone(), y), step=7)
    c = Mixer(cfg, replica=0)((x.clone(), y), step=7)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[1], c[1])
    assert not Mixer(digits_cfg(), 0).on


def test_soft_target_loss_is_cross_entropy_against_probabilities():
    torch.manual_seed(0)
    logits, w = torch.randn(N, C), [torch.randn(4, 3)]
    x, y = labelled_images()
    _, target = mix(x, y, C, Draw("mixup", 0.7), smoothing=0.1)
    by_hand = -(target * logits.log_softmax(1)).sum(1).mean() + 0.5 * 1e-2 * (w[0] ** 2).sum()
    assert loss_fn(logits, target, w, 1e-2).item() == pytest.approx(by_hand.item(), rel=1e-6)


def test_label_smoothing_matches_torchs():
    torch.manual_seed(0)
    logits, y = torch.randn(N, C), torch.randint(0, C, (N,))
    ours = F.cross_entropy(logits, soft_targets(y, C, 0.1))
    assert ours.item() == pytest.approx(F.cross_entropy(logits, y, label_smoothing=0.1).item(), rel=1e-6)
    # smoothed then mixed (timm's order) is torch's smoothing of the mixed targets: the two are linear
    _, target = mix(torch.zeros(N, 3, H, W), y, C, Draw("mixup", 0.3), smoothing=0.1)
    _, plain = mix(torch.zeros(N, 3, H, W), y, C, Draw("mixup", 0.3))
    assert torch.allclose(target, plain * 0.9 + 0.1 / C)


def test_the_noise_scales_half_batch_uses_the_soft_targets(digits_cfg, tmp_path):
    """train.noise_every: job.loss's second backward, over the batch's first half, is toward those
    images' soft targets (by hand here), not their hard labels; the half mixes only its own images."""
    cfg = digits_cfg("train.steps=1", "train.noise_every=1", "data.mixup_alpha=0.4", "data.cutmix_alpha=1.0",
                     "train.label_smoothing=0.1")
    assert (partners(cfg.data.batch_size)[:cfg.data.batch_size // 2] < cfg.data.batch_size // 2).all()
    with Job(cfg, tmp_path / "r", progress=False) as job:
        model, optimizer = job.wrap(scaletrain.build_model(cfg.model))
        params, wd = job.strategy.params, cfg.optim.weight_decay
        for x, y in job.batches():
            assert y.shape == (len(x), cfg.model.num_classes) and torch.allclose(y.sum(1), torch.ones(len(x)))
            optimizer.zero_grad()
            out = model(x)
            half = len(y) // 2

            def half_sq(target):
                loss = -(target * out[:half].log_softmax(1)).sum(1).mean() + \
                    0.5 * wd * sum((q ** 2).sum() for q in job._decayed)
                return squared_norm(torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True))

            soft, hard = half_sq(y[:half]), half_sq(F.one_hot(y[:half].argmax(1), cfg.model.num_classes).float())
            loss = job.loss(out, y)
            measured = job._half_sq
            loss.backward()
            job.step(loss)
    assert measured.item() == pytest.approx(soft.item(), rel=1e-4)
    assert measured.item() != pytest.approx(hard.item(), rel=1e-2)


def test_mixing_with_emulated_compute_is_refused(digits_cfg):
    with pytest.raises(ConfigError, match=r"data\.mixup_alpha = 0\.2: train\.emulate_compute_s = 0\.01 reads no data"):
        digits_cfg("data.mixup_alpha=0.2", "train.emulate_compute_s=0.01", "train.eval_every=0")


def test_a_run_with_mixup_cutmix_and_smoothing_reaches_its_summary(tmp_path, env):
    p = subprocess.run(scaletrain_cmd("train", "--recipe", str(RECIPES / "digits.toml"), "--quiet",
                                      "--set", "train.steps=4", "--set", "data.workers=0", "--set", "train.eval_every=4",
                                      "--set", "data.mixup_alpha=0.2", "--set", "data.cutmix_alpha=1.0",
                                      "--set", "train.label_smoothing=0.1", "--run-dir", str(tmp_path / "run")),
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["final_train_loss"] > 0 and 0 <= summary["test_accuracy"] <= 1
