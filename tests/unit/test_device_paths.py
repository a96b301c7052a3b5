"""Device paths whose logic runs on a CPU: the choices the GPU paths make (autocast, pinned host
copies, CUDA random states), and what they keep on gloo (DDP's gradient buckets, the emulated GPU's
order of sync and sleep). What only a GPU shows is in tests/gpu/test_gpu_paths.py."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from scaletrain import checkpoint, compute, metrics, resume
from scaletrain.compute import Emulated, autocast_dtype, grads_to_none
from scaletrain.config import load_config
from scaletrain.metrics import pinned
from scaletrain.perfmodel.calibrate import copy_buffers, measure_copy
from scaletrain.replicas import evaluate

from conftest import run_gloo_pair

# Two gloo processes train a small model under DDP with gradient_as_bucket_view (as the strategies
# build it) through Backprop. A hook that runs when autograd has accumulated a parameter's gradient
# (before DDP's own hook) records where the gradient lies: in DDP's bucket view, or in a fresh
# tensor that DDP must copy into the bucket. Phase "kept" is Backprop as built; phase "dropped"
# forces zero_grad(set_to_none=True), which shows that the hook tells the two apart.
DDP_SCRIPT = r'''
import datetime, json, os, sys
import torch, torch.distributed as tdist
from scaletrain.compute import Backprop, grads_to_none
from scaletrain.config import load_config
from scaletrain.strategies.allreduce import data_parallel

rank, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
torch.set_num_threads(1)
tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                         timeout=datetime.timedelta(seconds=60))
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
ddp = data_parallel(model, None)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
gen = torch.Generator().manual_seed(rank)
batches = [(torch.randn(4, 6, generator=gen), torch.randint(0, 3, (4,), generator=gen)) for _ in range(8)]
work = Backprop(load_config(None), ddp, opt)
batches = iter(batches)
seen = {}
for i, p in enumerate(model.parameters()):
    p.register_post_accumulate_grad_hook(lambda p, i=i: seen.__setitem__(i, p.grad.data_ptr()))
res = {"to_none": work.to_none, "compiled_to_none": grads_to_none(torch.compile(ddp))}
for _ in range(2):  # the first backward makes the gradients DDP's bucket views; DDP then rebuilds its
    work(next(batches)); opt.step()  # buckets in the order the gradients came, and the second moves them there
views = [p.grad.data_ptr() for p in model.parameters()]
res["one_storage"] = len({p.grad.untyped_storage().data_ptr() for p in model.parameters()}) == 1
for phase in ("kept", "dropped"):
    if phase == "dropped":
        work.to_none = True
    res[phase] = []
    for _ in range(3):
        work(next(batches)); opt.step()
        res[phase].append([seen[i] == v for i, v in enumerate(views)])
    res[phase + "_after"] = [p.grad.data_ptr() for p in model.parameters()] == views
with open(f"{out}/ddp{rank}.json", "w") as f:
    json.dump(res, f)
tdist.destroy_process_group()
# As a job's processes end (launch/join.exit_now): without interpreter teardown, in which gloo's threads
# being destroyed aborted a finished process (SIGABRT) now and then on a loaded machine.
os._exit(0)
'''


def test_ddp_gradients_stay_views_of_its_buckets(tmp_path):
    run_gloo_pair(tmp_path, "ddp.py", DDP_SCRIPT, timeout=120)
    for r in range(2):
        res = json.loads((tmp_path / f"ddp{r}.json").read_text())
        assert res["to_none"] is False and res["compiled_to_none"] is False and res["one_storage"]
        # zeroed in place: backward accumulates into the bucket every step
        assert all(all(step) for step in res["kept"]), res["kept"]
        # dropped: every step's gradients are fresh tensors, which DDP copies and points back at its views
        assert not any(any(step) for step in res["dropped"]), res["dropped"]
        assert res["kept_after"] and res["dropped_after"]


def test_grads_are_dropped_where_nothing_keeps_views_of_them():
    model = torch.nn.Linear(3, 2)
    assert grads_to_none(model) and grads_to_none(torch.compile(model))


def test_emulated_gpu_syncs_before_it_sleeps(monkeypatch):
    """The previous step's queued work finishes before the sleep that stands for this step's compute
    (a spy: CUDA cannot run here; tests/gpu shows it with queued kernels)."""
    calls = []
    real_sync, real_sleep = metrics.sync, compute.time.sleep
    monkeypatch.setattr(metrics, "sync", lambda d: (calls.append(("sync", d)), real_sync(d))[1])
    monkeypatch.setattr(compute.time, "sleep", lambda s: (calls.append(("sleep", s)), real_sleep(s))[1])
    cfg = load_config(None, ["train.emulate_compute_s=0.01"])
    work = Emulated(cfg, torch.nn.Linear(3, 2), torch.device("cpu"))
    work(None)
    assert calls == [("sync", torch.device("cpu")), ("sleep", 0.01)]


class Recorder(torch.nn.Module):
    """A linear layer that records the type its forward autocasts to (None: no autocast)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.seen = torch.nn.Linear(4, 3), []

    def forward(self, x):
        kind = x.device.type
        self.seen.append(torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None)
        return self.lin(x)


def test_autocast_follows_precision_on_cuda_only():
    for dev in ("cuda:0", "cuda:3"):
        assert autocast_dtype("bf16", torch.device(dev)) == torch.bfloat16
        assert autocast_dtype("fp32", torch.device(dev)) is None
    assert autocast_dtype("bf16", torch.device("cpu")) is None  # documented: autocast on CUDA only


def test_evaluation_runs_at_the_training_precision_on_cpu():
    model, cpu = Recorder(), torch.device("cpu")
    batches = [(torch.randn(5, 4), torch.randint(0, 3, (5,)))]
    for precision in ("fp32", "bf16"):
        res = evaluate(model, batches, cpu, lambda b: b, None, 1, precision)
        assert res["test_images"] == 5
    assert model.seen == [None, None]


def test_host_copies_pinned_from_gpus_only():
    assert pinned(torch.device("cuda", 0)) and pinned(torch.device("cuda", 7))
    assert not pinned(torch.device("cpu"))
    state = {"model": {"w": torch.ones(3)}, "steps": [torch.tensor(2)]}
    snap = checkpoint.snapshot(state)
    state["model"]["w"].add_(1)
    assert snap["model"]["w"].tolist() == [1.0] * 3 and not snap["model"]["w"].is_pinned()
    _, dst = copy_buffers(10, torch.device("cpu"))
    assert not dst.is_pinned()
    assert measure_copy(1000, torch.device("cpu")) > 0


def test_evaluation_autocasts_as_training_does(monkeypatch):
    """Where the choice says bf16 (here made to say so for this CPU, whose autocast runs), training's
    forward and evaluation's both run under it."""
    monkeypatch.setattr(compute, "autocast_dtype", lambda precision, device: torch.bfloat16)
    model, cpu = Recorder(), torch.device("cpu")
    batches = [(torch.randn(5, 4), torch.randint(0, 3, (5,)))]
    cfg = load_config(None, ["train.precision=bf16", "optim.weight_decay=0"])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    forward, keys = compute.around(model, opt, "bf16", False, cpu)  # job.wrap's module
    work = compute.Backprop(cfg, forward, opt)
    work(batches[0])
    evaluate(model, batches, cpu, lambda b: b, None, 1, "bf16")
    assert model.seen == [torch.bfloat16, torch.bfloat16]


def test_cuda_random_state_of_this_device_only():
    states = [torch.full((16,), i, dtype=torch.uint8) for i in range(4)]  # a chief that saw 4 GPUs
    # a resumed process with 1 visible GPU (index 0) takes the first; restoring all 4 raised IndexError
    assert resume.cuda_rng_for(states, 0) is states[0]
    assert resume.cuda_rng_for(states, 3) is states[3]
    assert resume.cuda_rng_for(states[:1], 2) is None  # more GPUs here than the chief saw
    assert resume.cuda_rng_for(states[2], 5) is states[2]  # saved as one state: the chief's device's
    # a process on no GPU saves no CUDA state, and restores none from an old checkpoint of 4 GPUs
    st = resume.rng_state()
    assert "cuda" not in st
    old = {"torch": st["torch"], "cuda": states}
    resume.set_rng_state(old)
    drawn = torch.rand(2)
    resume.set_rng_state(old)
    assert torch.equal(torch.rand(2), drawn) and not torch.cuda.is_initialized()


class Seen(torch.nn.Module):
    """A classifier of the digits' images that records the type each forward autocasts to."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.seen = torch.nn.Linear(3 * 16 * 16, 10), []

    def forward(self, x):
        self.seen.append(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None)
        return self.lin(x.flatten(1))


def own_loop(cfg, run_dir, net, call_network=False):
    from scaletrain.job import Job

    with Job(cfg, run_dir, progress=False) as job:
        model, optimizer = job.wrap(net)
        for x, y in job.batches():
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy((net if call_network else model)(x).float(), y)
            loss.backward()
            job.step(loss)
    return json.loads((Path(run_dir) / "summary.json").read_text())


def test_a_loop_of_ones_own_runs_its_forward_at_the_recipes_precision(monkeypatch, digits_cfg, tmp_path):
    """job.wrap's module autocasts as train.precision says, so a loop's own `model(x)` gets bf16 as the
    built-in loop does (bf16 is CUDA's: autocast_dtype is made to say so for this CPU, whose autocast runs)."""
    monkeypatch.setattr(compute, "autocast_dtype",
                        lambda precision, device: torch.bfloat16 if precision == "bf16" else None)
    net = Seen()
    own_loop(digits_cfg("train.steps=3", "train.eval_every=0", "train.precision=bf16", "train.device=auto"),
             tmp_path / "bf16", net)
    assert len(net.seen) >= 3 and set(net.seen) == {torch.bfloat16}, net.seen
    assert not torch.is_autocast_enabled("cpu")  # left after each forward
    fp32 = Seen()
    own_loop(digits_cfg("train.steps=3", "train.eval_every=0", "train.device=auto"), tmp_path / "fp32", fp32)
    assert set(fp32.seen) == {None}


def test_compile_is_not_applied_where_the_loop_calls_the_network_itself(digits_cfg, tmp_path):
    """train.compile acts in the module job.wrap returns; a loop that calls its network instead trains
    uncompiled, and summary.json says so."""
    cfg = digits_cfg("train.steps=2", "train.eval_every=0", "train.compile=true")
    summary = own_loop(cfg, tmp_path, Seen(), call_network=True)
    assert summary["not_applied"] == {"train.compile": "the loop's forwards did not call the module job.wrap() "
                                                       "returned"}
