"""The trainer's features on a GPU: mixing on the batch's device, the weights' average, gradient
accumulation and the decoupled optimizers, at bf16 and channels-last, under all-reduce and a
parameter server. Their logic is tested on a CPU (tests/unit/test_mixing.py, test_ema.py,
test_grad_accum.py, test_optimizers.py); here, that the CUDA paths run and agree with it."""

import pytest
import torch

from scaletrain.ema import Ema
from scaletrain.mixing import draw, mix

from .runs import max_diff

pytestmark = pytest.mark.gpu

FEATURES = ["train.device=cuda", "model.name=resnet8", "data.workers=0", "train.precision=bf16",
            "train.channels_last=true", "data.mixup_alpha=0.2", "data.cutmix_alpha=1.0", "train.label_smoothing=0.1",
            "train.ema_decay=0.99", "train.grad_accum_steps=2", "train.steps=12", "train.eval_every=6",
            "train.log_every=2", "train.warmup_log_steps=1"]
TWO_NODES_ONE_GPU = ["cluster.nodes=2", "cluster.gpus_per_node=1", "cluster.backend=gloo"]


def test_mixing_on_the_gpu_equals_the_cpu():
    x, y = torch.rand(8, 3, 16, 16), torch.arange(8) % 5
    for step in range(6):  # both kinds come up: draw() picks CutMix or mixup per step
        d = draw(0.2, 1.0, 0, step, 0, 16, 16)
        on_cpu = mix(x.clone(), y, 5, d, 0.1)
        on_gpu = mix(x.cuda().to(memory_format=torch.channels_last), y.cuda(), 5, d, 0.1)
        assert on_gpu[0].is_cuda and on_gpu[1].is_cuda
        torch.testing.assert_close(on_gpu[0].cpu(), on_cpu[0])
        torch.testing.assert_close(on_gpu[1].cpu(), on_cpu[1])


def test_the_average_on_the_gpu_equals_the_cpu():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
    gpu = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4)).cuda()
    gpu.load_state_dict(model.state_dict())
    averages = Ema(0.9, model), Ema(0.9, gpu)
    for _ in range(5):
        with torch.no_grad():
            for m in (model, gpu):
                for p in m.parameters():
                    p.add_(0.1)
        for a in averages:
            a.update()
    for cpu_avg, gpu_avg in zip(*(a.avg for a in averages)):
        torch.testing.assert_close(gpu_avg.cpu(), cpu_avg)


@pytest.mark.parametrize("optimizer", ["adamw", "lamb"])
def test_every_feature_at_once_under_allreduce(train_run, optimizer):
    run = train_run(optimizer, *FEATURES, *TWO_NODES_ONE_GPU, f"optim.name={optimizer}", "optim.lr=0.003")
    s = run.summary
    assert s["steps"] == 12 and s["images_applied"] == 12 * 2 * 2 * 32  # steps x replicas x micro-batches x batch
    assert s["test_accuracy"] is not None and s["test_accuracy_ema"] is not None
    assert all(torch.isfinite(w).all() for w in run.weights.values())


def test_lamb_on_a_parameter_server_equals_allreduce(train_run):
    """The shard steps lamb layer by layer on the host; all-reduce steps it on the GPU: the same
    weights up to the order of float sums (group norm, no mixing, fp32)."""
    exact = ["train.device=cuda", "model.name=resnet8", "model.norm=group", "data.workers=0", "data.augment=none",
             "train.deterministic=true", "train.steps=4", "data.batch_size=8", "optim.name=lamb", "optim.lr=0.003",
             "cluster.sharding=round-robin", "train.eval_every=0", *TWO_NODES_ONE_GPU]
    sync = train_run("sync", *exact, "strategy.name=sync", "cluster.num_ps=1")
    allreduce = train_run("allreduce", *exact, "strategy.name=allreduce")
    assert max_diff(sync.weights, allreduce.weights) <= 1e-4
