"""What only a GPU shows of the device paths: queued work, the device's clock, pinned host memory,
mixed precision and CUDA random states. Their logic is tested on a CPU in tests/unit/test_device_paths.py."""

from __future__ import annotations

import pytest
import torch

from scaletrain import checkpoint, compute, resume
from scaletrain.compute import Emulated
from scaletrain.config import load_config
from scaletrain.metrics import DeviceTimer
from scaletrain.perfmodel.calibrate import copy_buffers
from scaletrain.replicas import evaluate
from scaletrain.strategies.base import Counters

from .runs import DIGITS, SYNTHETIC

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SPIN = 1 << 30  # cycles of torch.cuda._sleep: a kernel that keeps the GPU busy for some hundred ms


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def test_emulated_sleep_does_not_hide_queued_work(monkeypatch):
    """The previous step's work, still queued when the emulated step starts, has finished when the
    sleep that stands for this step's compute begins."""
    cfg = load_config(None, ["train.emulate_compute_s=0.01"])
    work = Emulated(cfg, torch.nn.Linear(3, 2).to(device()), device())
    torch.cuda._sleep(SPIN)
    queued = torch.cuda.Event()
    queued.record()
    assert not queued.query()  # still running: there is work the sleep could hide
    done_at_sleep, real_sleep = [], compute.time.sleep
    monkeypatch.setattr(compute.time, "sleep", lambda s: (done_at_sleep.append(queued.query()), real_sleep(s))[1])
    work(None)
    assert done_at_sleep == [True]


def test_communication_timer_counts_queued_work_and_syncs_only_when_read():
    """A collective on a GPU returns once queued: the timer's events hold its work on the stream,
    the block does not wait for it, and reading the timer (a log point) does."""
    counters = Counters(device())
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with counters.timed("comm_s"):
        a.record()
        torch.cuda._sleep(SPIN)  # stands for a queued NCCL collective
        b.record()
    assert not b.query()  # no sync in the timed block
    seconds = counters.comm_s
    assert b.query()
    assert seconds >= a.elapsed_time(b) / 1e3  # the timer's interval holds the work's


def test_device_timer_folds_what_has_passed_without_a_sync():
    timer, x = DeviceTimer(device()), torch.zeros(1, device=device())
    for _ in range(50):
        with timer.timing():
            x.add_(1)
        torch.cuda.synchronize()  # the test's, so that every interval has passed
    assert len(timer.pending) <= 1  # read as new ones start: the list stays short between log points
    assert timer.seconds() > 0 and not timer.pending


class Recorder(torch.nn.Module):
    """A linear layer that records the type its forward autocasts to (None: no autocast)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.seen = torch.nn.Linear(4, 3), []

    def forward(self, x):
        self.seen.append(torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None)
        return self.lin(x)


def test_evaluation_autocasts_under_bf16():
    model = Recorder().to(device())
    batches = [(torch.randn(5, 4, device=device()), torch.randint(0, 3, (5,), device=device()))]
    for precision in ("bf16", "fp32"):
        assert evaluate(model, batches, device(), lambda b: b, None, 1, precision)["test_images"] == 5
    assert model.seen == [torch.bfloat16, None]


def test_checkpoint_snapshot_is_pinned_and_whole_when_it_returns():
    """Copies queued behind other work: snapshot's one sync makes them whole before the writer reads."""
    w = torch.zeros(1 << 20, device=device())
    torch.cuda._sleep(SPIN)
    w.fill_(7.0)  # queued behind the spin: the copy must wait for it
    snap = checkpoint.snapshot({"model": {"w": w}, "step": 3})
    w.fill_(0.0)  # a later training step
    assert snap["step"] == 3 and snap["model"]["w"].device.type == "cpu" and snap["model"]["w"].is_pinned()
    assert bool((snap["model"]["w"] == 7.0).all())


def test_calibrated_copy_is_into_pinned_memory_as_the_push_is():
    src, dst = copy_buffers(1000, device())
    assert src.device.type == "cuda" and dst.is_pinned()


def test_cuda_random_state_of_this_device_round_trips():
    dev = device()  # sets CUDA up, as a process training on its GPU has
    torch.cuda.manual_seed(1)
    st = resume.rng_state()
    assert isinstance(st["cuda"], torch.Tensor)  # this device's state alone
    drawn = torch.rand(4, device=dev)
    resume.set_rng_state(st)
    assert torch.equal(torch.rand(4, device=dev), drawn)
    # a checkpoint written before: a state for every GPU the chief saw, more than are visible here
    resume.set_rng_state({"torch": st["torch"], "cuda": [st["cuda"]] * (torch.cuda.device_count() + 3)})
    assert torch.equal(torch.rand(4, device=dev), drawn)


class Seen(torch.nn.Module):
    """A classifier of the digits recipe's images that records the type each forward autocasts to."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.seen = torch.nn.Linear(3 * 16 * 16, 10), []

    def forward(self, x):
        self.seen.append(torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None)
        return self.lin(x.flatten(1))


def test_a_loop_of_ones_own_runs_its_forward_in_bf16(tmp_path):
    """train.precision = bf16 reaches a loop's own `model(x)` (job.wrap's module autocasts), and
    summary.json says nothing is left unapplied."""
    import json

    from scaletrain.job import Job

    cfg = load_config(DIGITS, [*SYNTHETIC, "train.device=cuda", "train.precision=bf16", "train.steps=3",
                               "train.eval_every=0", "data.workers=0"])
    net, outputs = Seen(), []
    with Job(cfg, tmp_path / "run", progress=False) as job:
        model, optimizer = job.wrap(net)
        for x, y in job.batches():
            optimizer.zero_grad()
            out = model(x)
            outputs.append(out.dtype)
            loss = torch.nn.functional.cross_entropy(out.float(), y)
            loss.backward()
            job.step(loss)
    assert outputs == [torch.bfloat16] * 3 and net.seen[:3] == [torch.bfloat16] * 3, (outputs, net.seen)
    assert not torch.is_autocast_enabled("cuda")  # left after each forward
    assert net.lin.weight.dtype == torch.float32 and net.lin.weight.grad.dtype == torch.float32
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["not_applied"] == {} and summary["steps"] == 3
