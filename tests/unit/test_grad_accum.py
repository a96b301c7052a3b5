"""Gradient accumulation in one process (train.grad_accum_steps = k).

An update of k micro-batches of b images is the update of one batch of k x b (on a network without
BatchNorm, whose statistics are per forward): the built-in loop's, and a user's loop that zeroes
its gradients before every backward. A job step is an update, and every figure counts its images.
A resumed run goes on at the update it stopped at, as a straight one does.
"""

import json

import pytest
import torch
from safetensors.torch import load_file

import scaletrain
from scaletrain import schedule
from scaletrain.config import ConfigError
from scaletrain.job import Job
from scaletrain.loop import train
from scaletrain.noise import NoiseScale
from scaletrain.perfmodel.profile import Profile, accumulated
from scaletrain.strategies import images_per_update, push_images

# GroupNorm: the update's gradient does not depend on how its images are split into forwards
BASE = ("model.norm=group", "model.width=8", "data.augment=[]", "train.steps=3", "train.log_every=1",
        "optim.warmup_steps=0")


def weights(run_dir):
    return load_file(str(run_dir / "model.safetensors"))


def user_loop(cfg, run_dir):
    """A loop of one's own, which zeroes the gradients before every backward as loops do."""
    with Job(cfg, run_dir, progress=False) as job:
        model, optimizer = job.wrap(scaletrain.build_model(cfg.model))
        for x, y in job.batches():
            optimizer.zero_grad()
            loss = job.loss(model(x), y)
            loss.backward()
            job.step(loss)
    return job.figures()


@pytest.mark.parametrize("loop", [train, user_loop], ids=["builtin", "user"])
def test_k_micro_batches_make_the_update_of_one_k_times_larger_batch(digits_cfg, tmp_path, loop):
    whole = train(digits_cfg(*BASE, "data.batch_size=32"), tmp_path / "whole", progress=False)
    parts = loop(digits_cfg(*BASE, "data.batch_size=8", "train.grad_accum_steps=4"), tmp_path / "parts")
    a, b = weights(tmp_path / "whole"), weights(tmp_path / "parts")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-5)
    for key in ("steps", "images_applied", "train_images"):
        assert parts[key] == whole[key], key
    assert parts["steps"] == 3 and parts["images_applied"] == 96
    assert parts["final_train_loss"] == pytest.approx(whole["final_train_loss"], rel=1e-4)
    rows = [json.loads(line) for line in (tmp_path / "parts" / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train_rows] == [1, 2, 3] and [r["images"] for r in train_rows] == [32, 64, 96]


def test_a_resumed_run_goes_on_at_its_update(digits_cfg, tmp_path):
    cfg = digits_cfg(*BASE, "train.steps=4", "data.batch_size=8", "train.grad_accum_steps=2",
                     "train.checkpoint_every=2", "optim.schedule=step", "optim.step_size=2")
    train(cfg, tmp_path / "straight", progress=False)
    train(cfg.replace(**{"train.steps": 2}), tmp_path / "resumed", progress=False)
    s = train(cfg, tmp_path / "resumed", resume=True, progress=False)
    assert s["start_step"] == 2 and s["steps"] == 4 and s["images_applied"] == 64
    a, b = weights(tmp_path / "straight"), weights(tmp_path / "resumed")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_job_step_is_an_update_in_every_figure(digits_cfg):
    cfg = digits_cfg("data.batch_size=8", "train.grad_accum_steps=4", "cluster.nodes=2", "cluster.gpus_per_node=2",
                     "train.steps=0")
    assert schedule.step_images(cfg) == 2 * 2 * 8 * 4
    assert schedule.from_config(cfg, 1000).steps == 1000 // 128  # an epoch: 7 updates of 128 images
    assert images_per_update(cfg) == 128
    ps = cfg.replace(**{"strategy.name": "async", "cluster.num_ps": 1})
    assert push_images(ps) == images_per_update(ps) == 32  # one replica's 4 micro-batches
    assert images_per_update(cfg.replace(**{"strategy.name": "sync", "cluster.num_ps": 1})) == 128
    emulated = digits_cfg("data.batch_size=8", "train.grad_accum_steps=4", "strategy.name=async-allreduce",
                          "strategy.emulate_workers=3")
    assert images_per_update(emulated) == 3 * 32


def test_the_performance_model_computes_k_micro_batches_an_update():
    p = Profile(batch_per_replica=16, compute_s=0.2, compute_base_s=0.05)
    q = accumulated(p, 4)
    assert (q.batch_per_replica, q.compute_s, q.compute_base_s) == (64, 0.8, 0.2)
    assert accumulated(p, 1) is p


def test_the_noise_scale_of_summed_micro_batches_is_that_of_their_mean():
    plain, summed = NoiseScale(8, 32, torch.device("cpu")), NoiseScale(8, 32, torch.device("cpu"), sum_of=4)
    for own, mean in ((3.0, 1.5), (2.5, 1.0)):
        plain.add(torch.tensor(own), torch.tensor(mean))
        summed.add(torch.tensor(own * 16), torch.tensor(mean * 16))  # the sum of 4 is 4 times the mean
        plain.step()
        summed.step()
    assert summed.window() == pytest.approx(plain.window())


def test_pipeline_stages_refuse_accumulation_in_one_line(digits_cfg):
    with pytest.raises(ConfigError, match=r"train.grad_accum_steps = 2: not with parallel.stages = 2"):
        digits_cfg("train.grad_accum_steps=2", "parallel.stages=2", "cluster.gpus_per_node=2")
