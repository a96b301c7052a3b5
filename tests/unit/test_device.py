"""Device logic on CPU with made-up GPUs (device.py, plan.gpu_map): which GPU each rank takes,
what a host or a torch build cannot give, and the settings that cannot take effect."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from scaletrain import device
from scaletrain.config import ClusterConfig, build_config
from scaletrain.errors import ConfigError, PlanError
from scaletrain.models import build_model
from scaletrain.optim import loss_fn
from scaletrain.plan import gpu_map, make_plan


def gpus_of(plan):
    return [p.device for p in plan.procs]


def test_emulated_nodes_on_one_host_never_share_a_gpu():
    plan = make_plan(ClusterConfig(nodes=2, gpus_per_node=2, num_ps=1), True, gpus=4, one_host=True)
    assert gpus_of(plan) == ["cuda:0", "cuda:1", "cuda:2", "cuda:3", "cpu"]  # node 2: worker GPUs 2-3, PS none
    workers = [p.device for p in plan.workers]
    assert len(set(workers)) == len(workers)


def test_each_host_of_its_own_counts_from_gpu_0():
    plan = make_plan(ClusterConfig(nodes=3, gpus_per_node=4, num_ps=3), True, gpus=4)
    for node in range(3):
        assert [p.device for p in plan.on_node(node) if p.role == "worker"] == [f"cuda:{r}" for r in range(4)]
    assert {p.device for p in plan.ps} == {"cpu"}


@pytest.mark.parametrize("nodes,per_node,gpus", [(4, 2, 1), (2, 2, 3), (1, 8, 4)])
def test_a_local_job_asking_more_gpus_than_the_host_has_fails_naming_both(nodes, per_node, gpus):
    with pytest.raises(PlanError) as e:
        make_plan(ClusterConfig(nodes=nodes, gpus_per_node=per_node), False, gpus=gpus, one_host=True)
    msg = str(e.value)
    assert f"{nodes * per_node} GPUs" in msg and f"but {gpus} " in msg and "\n" not in msg
    assert "train.device = 'cpu'" in msg and "cluster.nodes" in msg and "emulate_compute_s" in msg


def test_gpus_per_node_above_the_hosts_gpus_fails_under_torchrun_or_slurm():
    with pytest.raises(PlanError, match="cluster.gpus_per_node = 4 needs 4 GPUs on each node but 2 are visible"):
        make_plan(ClusterConfig(nodes=2, gpus_per_node=4), False, gpus=2)


def test_gloo_between_gpus_lets_replicas_share_round_robin():
    assert gpu_map(2, 1, 1, one_host=True, share=True) == [0, 0]
    assert gpu_map(2, 3, 4, one_host=True, share=True) == [0, 1, 2, 3, 0, 1]
    plan = make_plan(ClusterConfig(nodes=2, gpus_per_node=1, num_ps=1, backend="gloo"), True, gpus=1, one_host=True)
    assert [p.device for p in plan.workers] == ["cuda:0", "cuda:0"]


def facts(visible=0, build="12.4", slurm=0):
    return device.Facts(visible, build, "2.13.0" + ("+cpu" if build is None else ""), slurm)


def test_resolve_device():
    assert device.resolve("auto", facts(visible=2)) == "cuda"
    assert device.resolve("cpu", facts(visible=2)) == "cpu"
    assert device.resolve("auto", facts(build=None)) == "cpu"  # a laptop: auto means the CPU
    with pytest.raises(PlanError, match="train.device = 'cuda' but torch 2.13.0\\+cpu is a CPU build"):
        device.resolve("cuda", facts(build=None))
    with pytest.raises(PlanError, match="no CUDA GPU is visible"):
        device.resolve("cuda", facts())


def test_a_cpu_torch_inside_a_gpu_allocation_is_an_error_naming_the_fix():
    with pytest.raises(PlanError, match="gives the node 4 GPUs but torch 2.13.0\\+cpu is a CPU build: install a "
                                        "CUDA build of torch.*train.device = 'cpu'"):
        device.resolve("auto", facts(build=None, slurm=4))
    with pytest.raises(PlanError, match="CUDA sees none"):
        device.resolve("auto", facts(slurm=4))
    assert device.resolve("cpu", facts(build=None, slurm=4)) == "cpu"


def test_slurm_gpus_from_the_allocation():
    assert device.slurm_gpus({"SLURM_GPUS_ON_NODE": "4"}) == 4
    assert device.slurm_gpus({"SLURM_JOB_GPUS": "0,1,2"}) == 3
    assert device.slurm_gpus({"SLURM_JOB_ID": "7"}) == 0


def test_cuda_only_settings_are_refused_or_recorded():
    with pytest.raises(ConfigError, match="train.precision = bf16: bf16 autocast runs on CUDA only"):
        build_config({"train": {"device": "cpu", "precision": "bf16"}})
    with pytest.raises(ConfigError, match="train.channels_last = True"):
        build_config({"train": {"device": "cpu", "channels_last": True}})
    cfg = build_config({"train": {"precision": "bf16", "channels_last": True}})  # auto: known at run time
    assert set(device.not_applied(cfg, "cpu")) == {"train.precision", "train.channels_last"}
    assert device.not_applied(cfg, "cuda") == {}


def test_async_bound_outside_async_allreduce_is_refused():
    with pytest.raises(ConfigError, match="strategy.async_bound = 2: bounds the rounds of strategy.name = "
                                          "async-allreduce; strategy.name = 'sync'"):
        build_config({"strategy": {"name": "sync", "async_bound": 2}, "cluster": {"num_ps": 1}})
    build_config({"strategy": {"name": "async-allreduce", "async_bound": 2}})


# Ops whose CUDA kernels raise under torch.use_deterministic_algorithms(True) (torch's docstring of it).
CUDA_NONDETERMINISTIC = ("adaptive_avg_pool2d_backward", "adaptive_avg_pool3d_backward", "avg_pool3d_backward",
                         "adaptive_max_pool2d_backward", "fractional_max_pool", "max_unpool", "upsample_",
                         "reflection_pad", "nll_loss2d", "ctc_loss", "embedding_bag", "put_", "histc",
                         "bincount", "median", "grid_sampler", "cumsum")


class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.add(func.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name,size", [("resnet8", 32), ("resnet18", 64), ("resnet50", 64)])
def test_built_in_models_use_no_op_without_a_deterministic_cuda_kernel(name, size):
    cfg = build_config({"model": {"name": name, "num_classes": 10}, "data": {"image_size": size}})
    model = build_model(cfg.model)
    x, y = torch.randn(2, 3, size, size), torch.tensor([1, 2])
    with Ops() as ops:
        loss_fn(model(x), y, list(model.parameters()), 1e-4).backward()
    bad = sorted(op for op in ops.seen if any(n in op for n in CUDA_NONDETERMINISTIC))
    assert not bad, f"{name} uses {bad}: train.deterministic would fail on a GPU"


@pytest.mark.parametrize("strategy", ["async", "async-allreduce"])  # DC-ASGD's past versions; a round's sum
def test_a_resumed_emulator_keeps_its_history_where_the_model_is(digits_cfg, strategy):
    """A checkpoint is read onto the CPU; the emulator's past versions and the round's summed
    gradients must go where the model is (a GPU: no CPU tensors mixed in). 'meta' stands for it."""
    from scaletrain.comm.groups import single
    from scaletrain.optim import build_optimizer
    from scaletrain.schedule import from_config
    from scaletrain.strategies.build import build_strategy

    cfg = digits_cfg("strategy.emulate_workers=4", f"strategy.name={strategy}", "model.name=resnet8",
                     *(["strategy.delay_compensation=0.5"] if strategy == "async" else []))
    def make(dev):
        model = build_model(cfg.model).to(dev)
        return build_strategy(cfg, single(), model, build_optimizer(cfg.optim, model.parameters()),
                              from_config(cfg, 1000))
    on_cpu = make("cpu")
    for p in on_cpu.params:
        p.grad = torch.ones_like(p)
    on_cpu.step(0.1)
    state = {"images": 0, **on_cpu.snapshot()}
    on_meta = make("meta")
    on_meta.restore(state)
    assert {t.device.type for v in on_meta.history for t in v} == {"meta"}
    assert {t.device.type for t in on_meta.summed} <= {"meta"} and (strategy == "async" or on_meta.summed)


def test_a_setting_the_device_cannot_take_is_recorded_as_not_applied(digits_cfg, tmp_path):
    import json

    from scaletrain.loop import train

    cfg = digits_cfg("train.steps=2", "model.name=resnet8", "train.precision=bf16", "train.device=auto")  # CPU here
    train(cfg, tmp_path, progress=False)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["not_applied"] == {"train.precision": "bf16: bf16 autocast runs on CUDA only; this run "
                                                         "computes on cpu"}


def test_cluster_setup_outside_the_sbatch_script_is_not_applied():
    cfg = build_config({"cluster": {"setup": ["module load cuda/12.4"]}, "train": {"device": "cpu"}})
    assert "run only by the sbatch script" in device.not_applied(cfg, "cpu", env={})["cluster.setup"]
    assert "cluster.setup" not in device.not_applied(cfg, "cpu", env={device.SETUP_DONE: "1"})
