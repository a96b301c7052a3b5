"""The Python API in one process: scaletrain.train, and a user's loop on scaletrain.Job.

The built-in loop is a Job's loop (loop.py): a user's loop that does what it does gives the same
job, to the bit. A loop that forgets job.step, steps twice or steps without a backward is told so
in one line, before any collective could wait for it.
"""

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

import scaletrain
from scaletrain import api
from scaletrain.config import Config, ConfigError, DataConfig, ModelConfig, TrainConfig
from scaletrain.errors import RunError
from scaletrain.job import Job
from scaletrain.loop import train


def user_loop(cfg, run_dir, forward_backward=False, **wrap):
    """What examples/custom_loop.py does, in this process; forward_backward: its branch for pipeline stages,
    job.forward_backward, which any job takes."""
    with Job(cfg, run_dir, progress=False) as job:
        model, optimizer = job.wrap(scaletrain.build_model(cfg.model), **wrap)
        for x, y in job.batches():
            optimizer.zero_grad()
            if forward_backward:
                loss = job.forward_backward(x, y)
            else:
                loss = job.loss(model(x), y)
                loss.backward()
            job.step(loss)
    return job.figures()


def test_the_package_exports_the_api():
    assert scaletrain.train is api.train and scaletrain.Job is Job and scaletrain.Config is Config
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        scaletrain.nope


@pytest.mark.parametrize("forward_backward", [False, True], ids=["own-forward", "job.forward_backward"])
def test_a_users_loop_is_the_built_in_loop_to_the_bit(digits_cfg, tmp_path, forward_backward):
    cfg = digits_cfg("train.steps=12", "train.eval_every=6", "train.checkpoint_every=6")
    builtin = train(cfg, tmp_path / "builtin", progress=False)
    mine = user_loop(cfg, tmp_path / "mine", forward_backward)
    a, b = load_file(tmp_path / "builtin" / "model.safetensors"), load_file(tmp_path / "mine" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for key in ("steps", "images_applied", "final_train_loss", "test_accuracy", "test_loss", "train_images"):
        assert mine[key] == builtin[key], key
    assert json.loads((tmp_path / "mine" / "summary.json").read_text())["test_accuracy"] == mine["test_accuracy"]
    assert sorted(p.name for p in (tmp_path / "mine" / "checkpoints").glob("*.pt")) == \
        sorted(p.name for p in (tmp_path / "builtin" / "checkpoints").glob("*.pt"))


@pytest.mark.parametrize("loop", ["builtin", "user"])
def test_one_process_measures_the_noise_scale_when_asked(digits_cfg, tmp_path, loop):
    """train.noise_every: one replica's noise scale from half its batch, in the rows and the summary,
    through job.loss in the built-in loop and in a user's; none by default."""
    cfg = digits_cfg("train.steps=40", "train.log_every=20", "train.noise_every=1")
    run = train if loop == "builtin" else user_loop
    summary = run(cfg, tmp_path / "on", progress=False) if loop == "builtin" else run(cfg, tmp_path / "on")
    rows = [json.loads(line) for line in (tmp_path / "on" / "metrics.jsonl").read_text().splitlines()]
    assert [r["noise_scale"] > 0 for r in rows if r["kind"] == "train" and "noise_scale" in r] == [True, True]
    assert summary["noise_scale"] > 0
    assert train(digits_cfg("train.steps=4"), tmp_path / "off", progress=False)["noise_scale"] is None


def test_noise_every_not_applied_is_said(digits_cfg, tmp_path):
    """A loop whose loss does not go through job.loss measures nothing: the summary says so."""
    cfg = digits_cfg("train.steps=4", "train.noise_every=1")
    with Job(cfg, tmp_path / "own", progress=False) as job:
        model, optimizer = job.wrap(scaletrain.build_model(cfg.model))
        for x, y in job.batches():
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            job.step(loss)
    summary = job.figures()
    assert summary["noise_scale"] is None and "job.loss" in summary["not_applied"]["train.noise_every"]
    assert "job.loss" not in train(cfg, tmp_path / "builtin", progress=False)["not_applied"].get("train.noise_every", "")


def test_train_takes_a_config_built_in_python_and_checks_it(tmp_path):
    cfg = Config(model=ModelConfig(name="resnet8", width=8), data=DataConfig(image_size=8, batch_size=16, workers=0),
                 train=TrainConfig(device="cpu", steps=4, eval_every=4))
    summary = scaletrain.train(cfg, {"train.steps": 3}, run_dir=tmp_path / "r", progress=False)
    assert summary["steps"] == 3 and summary["model"] == "resnet8" and (tmp_path / "r" / "summary.json").exists()
    bad = dataclasses.replace(cfg, train=TrainConfig(steps=-3))  # made in Python: checked as a recipe is
    with pytest.raises(ConfigError, match="train.steps"):
        scaletrain.train(bad, run_dir=tmp_path / "bad", progress=False)
    assert not (tmp_path / "bad").exists()


def test_train_takes_a_recipe_and_overrides_as_the_command_line_does(tmp_path):
    summary = scaletrain.train("recipes/digits.toml", ["train.steps=3", "data.workers=0", "train.eval_every=3"],
                               run_dir=tmp_path / "r", progress=False)
    assert summary["steps"] == 3 and summary["test_accuracy"] is not None


def test_a_checkpoint_asked_by_the_loop_is_taken_at_the_next_sync_point(digits_cfg, tmp_path):
    cfg = digits_cfg("train.steps=10", "train.checkpoint_every=0", "train.eval_every=0")
    with Job(cfg, tmp_path / "r", progress=False) as job:
        model, optimizer = job.wrap(scaletrain.build_model(cfg.model))
        for i, (x, y) in enumerate(job.batches()):
            optimizer.zero_grad()
            job.loss(model(x), y).backward()
            if i == 3:
                job.checkpoint()
            job.step(0.0)
    steps = sorted(int(p.stem.split("-")[1]) for p in (tmp_path / "r" / "checkpoints").glob("*.pt"))
    assert steps == [4, 10], steps  # asked during step 4; the last one is the job's end


@pytest.mark.parametrize("mistake, message", [
    ("no_step", "asked for the next batch before job.step"),
    ("two_steps", r"job.step\(\) was called twice for one batch"),
    ("no_backward", "the model has no gradients; call loss.backward()"),
])
def test_a_loop_that_steps_wrong_is_told_in_one_line(digits_cfg, tmp_path, mistake, message):
    cfg = digits_cfg("train.steps=5")
    with pytest.raises(RunError, match=message) as e:
        with Job(cfg, tmp_path / "r", progress=False) as job:
            model, optimizer = job.wrap(scaletrain.build_model(cfg.model))
            for x, y in job.batches():
                optimizer.zero_grad(set_to_none=True)
                loss = job.loss(model(x), y)
                if mistake != "no_backward":
                    loss.backward()
                if mistake != "no_step":
                    job.step(loss)
                if mistake == "two_steps":
                    job.step(loss)
    assert "\n" not in str(e.value)


def test_wrap_once_inside_with_and_before_anything_else(digits_cfg, tmp_path):
    cfg = digits_cfg("train.steps=2")
    job = Job(cfg, tmp_path / "r", progress=False)
    with pytest.raises(RunError, match=r"job.wrap\(\) outside `with`"):
        job.wrap(torch.nn.Linear(3, 10))
    with pytest.raises(RunError, match=r"job.wrap\(\) was called twice: a job trains one model"):
        with job:
            with pytest.raises(RunError, match=r"job.batches\(\) before job.wrap"):
                next(job.batches())
            job.wrap(torch.nn.Linear(3, 10))
            job.wrap(torch.nn.Linear(3, 10))


def test_a_loop_that_leaves_its_batches_early_is_told_so(digits_cfg, tmp_path):
    """Left early, a replica would leave the others waiting in the next collective: an error instead."""
    cfg = digits_cfg("train.steps=10")
    with pytest.raises(RunError, match="the loop left job.batches.. at step 3 of 10, before the job's end"):
        with Job(cfg, tmp_path / "r", progress=False) as job:
            model, optimizer = job.wrap(scaletrain.build_model(cfg.model))
            for i, (x, y) in enumerate(job.batches()):
                job.loss(model(x), y).backward()
                job.step(0.0)
                if i == 2:
                    break


def test_parameter_servers_take_no_optimizer_of_the_users(digits_cfg, tmp_path):
    cfg = digits_cfg("strategy.name=sync", "cluster.nodes=2", "cluster.num_ps=1")
    model = torch.nn.Linear(3, 10)
    with pytest.raises(ConfigError, match="strategy.name = 'sync': its parameter servers apply the updates"):
        with Job(cfg, tmp_path / "r", progress=False) as job:
            job.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_a_users_optimizer_is_stepped_where_replicas_apply_updates(digits_cfg, tmp_path):
    """Adam of the user's, under allreduce: the job steps it with the schedule's learning rate."""
    cfg = digits_cfg("train.steps=6", "train.eval_every=6", "optim.lr=0.01", "optim.warmup_steps=0",
                     "optim.schedule=constant")
    seen = []

    class Spy(torch.optim.Adam):
        def step(self, closure=None):
            seen.append(self.param_groups[0]["lr"])
            return super().step(closure)

    with Job(cfg, tmp_path / "r", progress=False) as job:
        model = scaletrain.build_model(cfg.model)
        wrapped, opt = job.wrap(model, Spy(model.parameters(), lr=1.0))
        for x, y in job.batches():
            opt.zero_grad()
            torch.nn.functional.cross_entropy(wrapped(x), y).backward()
            job.step(0.0)
    assert seen == [pytest.approx(0.01)] * 6
