"""GPU types and how fast each trains a network it was never measured on.

A GPU is its peak rates (dense FLOP/s by arithmetic mode, memory bandwidth) and its memory, from
the vendor's data sheets. Its step time for a network is a roofline over that network's operators
(layers.py): each takes the longer of its FLOPs at peak and its bytes at the memory bandwidth, and
the sum is divided by the GPU's achieved-rate factor, the fraction of that bound real training
reaches (kernels below peak, launch gaps, the loss and the optimizer's own traffic). The factor is
fitted, one per GPU and mode, to a published single-GPU measurement of ResNet-50 (POINTS, each with
its source); `python benchmarks/gpu_catalogue.py` refits them and checks them on ResNeXt-101
32x4d, a network not used to fit (grouped convolutions, far more bytes per FLOP).

A step also cannot be shorter than the host's work of launching its kernels: each operator costs
LAUNCH_S of CPU time in eager PyTorch, which bounds small batches on fast GPUs.

Modes: "fp32" (no tensor cores), "tf32" (what PyTorch's convolutions use for fp32 training on
Ampere and later, cudnn.allow_tf32 being on by default), "half" (bf16 or fp16 autocast).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ModelError
from .layers import StepCost

# Eager PyTorch's host time per operator (dispatch, then cudaLaunchKernel): PyTorch's own
# profiles put the dispatcher at about 4-8 us an operator and a CUDA launch at about 3-5 us.
# Assumed 10 us: ResNet-50's step of about 730 costed operators then needs 7 ms of host time,
# which binds only below some 40 images a step on an A100.
LAUNCH_S = 10e-6


@dataclass(frozen=True)
class GPU:
    name: str
    memory: int                 # bytes a process can use (the data sheet's capacity)
    bandwidth: float            # bytes/s of device memory (data sheet)
    peak: dict                  # mode -> dense FLOP/s (data sheet; sparsity not counted)
    sheet: str                  # where the figures come from


GB, TB = 1e9, 1e12
# Per die for the K80 (a card holds two); SXM parts for the others, the form of the published points.
CATALOGUE = {g.name: g for g in (
    GPU("k80", int(11.17 * 2**30), 240 * GB, {"fp32": 4.37 * TB},
        "NVIDIA Tesla K80 data sheet: 8.73 TFLOP/s fp32 at boost and 480 GB/s a card of two dies, 12 GB a die "
        "(11,441 MiB with ECC)"),
    GPU("v100-16gb", 16 * 2**30, 900 * GB, {"fp32": 15.7 * TB, "half": 125 * TB},
        "NVIDIA V100 data sheet (SXM2): 15.7 TFLOP/s fp32, 125 TFLOP/s tensor, 900 GB/s HBM2"),
    GPU("v100-32gb", 32 * 2**30, 900 * GB, {"fp32": 15.7 * TB, "half": 125 * TB},
        "NVIDIA V100 data sheet (SXM2): 15.7 TFLOP/s fp32, 125 TFLOP/s tensor, 900 GB/s HBM2"),
    GPU("a100-80gb", 80 * 2**30, 2039 * GB, {"fp32": 19.5 * TB, "tf32": 156 * TB, "half": 312 * TB},
        "NVIDIA A100 data sheet (SXM4 80GB): 19.5 TFLOP/s fp32, 156 tf32, 312 bf16/fp16 dense, 2,039 GB/s HBM2e"),
    GPU("h100-80gb", 80 * 2**30, 3350 * GB, {"fp32": 67 * TB, "tf32": 494.7 * TB, "half": 989.4 * TB},
        "NVIDIA H100 data sheet (SXM5): 67 TFLOP/s fp32, 495 tf32, 989 bf16/fp16 dense, 3.35 TB/s HBM3"),
    GPU("h200-141gb", 141 * 10**9, 4800 * GB, {"fp32": 67 * TB, "tf32": 494.7 * TB, "half": 989.4 * TB},
        "NVIDIA H200 data sheet (SXM): the H100's compute (67 TFLOP/s fp32, 495 tf32, 989 bf16 dense), 141 GB "
        "HBM3e at 4.8 TB/s"),
)}


@dataclass(frozen=True)
class Point:
    """One measured training rate of one GPU: what the factors are fitted to or checked on."""

    gpu: str
    mode: str
    model: str          # "resnet50" (ours, v1.5) or "resnext101-32x4d" (benchmarks/gpu_catalogue.py builds it)
    batch: int
    images_per_s: float
    source: str


DLE = ("NVIDIA DeepLearningExamples, PyTorch/Classification/ConvNets/{}/README.md, training performance, 1 GPU "
       "(pytorch-21.03 NGC container; batch from configs.yml)")
STUDY = "the study's one-node rate (shared reference): 124.18 img/s on 4 K80 dies at 32 images a die, TF 1.x"
OWN_H100 = ("benchmarks/results/gpu-check-2026-11-25T1705Z-b5cc5ab.json, overhead_workers8: this project's bare "
            "loop, median of 3, bf16 channels-last, 8 loader processes; the loaders may have bounded it, so a low "
            "estimate")
OWN_H200 = ("benchmarks/results/gpu-rates-2026-11-27T1600Z-h200.json (benchmarks/gpu_rates.py): this project's "
            "bare step on a batch already on the GPU, median of 3 windows of 15 steps, torch 2.11 + CUDA 13")
POINTS = (
    Point("k80", "fp32", "resnet50", 32, 124.18 / 4, STUDY),
    Point("v100-16gb", "fp32", "resnet50", 112, 367, DLE.format("resnet50v1.5")),
    Point("v100-16gb", "half", "resnet50", 256, 1200, DLE.format("resnet50v1.5")),
    Point("v100-32gb", "fp32", "resnet50", 112, 356, DLE.format("resnet50v1.5")),
    Point("v100-32gb", "half", "resnet50", 256, 1156, DLE.format("resnet50v1.5")),
    Point("a100-80gb", "tf32", "resnet50", 256, 938, DLE.format("resnet50v1.5")),
    Point("a100-80gb", "half", "resnet50", 256, 2470, DLE.format("resnet50v1.5")),
    Point("h100-80gb", "half", "resnet50", 64, 2928.96, OWN_H100),
    Point("h200-141gb", "half", "resnet50", 256, 4716.3, OWN_H200),
    Point("h200-141gb", "tf32", "resnet50", 256, 2219.4, OWN_H200),
)
CHECKS = (  # held out: never fitted to
    Point("v100-16gb", "fp32", "resnext101-32x4d", 64, 147, DLE.format("resnext101-32x4d")),
    Point("v100-16gb", "half", "resnext101-32x4d", 128, 587, DLE.format("resnext101-32x4d")),
    Point("v100-32gb", "fp32", "resnext101-32x4d", 64, 144, DLE.format("resnext101-32x4d")),
    Point("v100-32gb", "half", "resnext101-32x4d", 128, 565, DLE.format("resnext101-32x4d")),
    Point("a100-80gb", "tf32", "resnext101-32x4d", 128, 456, DLE.format("resnext101-32x4d")),
    Point("a100-80gb", "half", "resnext101-32x4d", 128, 1211, DLE.format("resnext101-32x4d")),
    Point("h200-141gb", "half", "resnext101-32x4d", 128, 2268.8, OWN_H200),
    Point("h200-141gb", "tf32", "resnext101-32x4d", 128, 1080.3, OWN_H200),
)

# Achieved fraction of the roofline, per GPU and mode: `python benchmarks/gpu_catalogue.py` fits
# them to POINTS (tests/unit/test_cluster.py checks these equal its fit). H100 tf32 has no point;
# it takes the H100's half factor times the H200's tf32/half ratio (the same GH100 chip, measured
# alike), and says so (DERIVED). The A100's ratio (0.76) would put the H200's tf32 19% below its measured rate.
FACTOR = {
    ("k80", "fp32"): 0.2456,
    ("v100-16gb", "fp32"): 0.798,
    ("v100-16gb", "half"): 0.6436,
    ("v100-32gb", "fp32"): 0.7741,
    ("v100-32gb", "half"): 0.62,
    ("a100-80gb", "tf32"): 0.4308,
    ("a100-80gb", "half"): 0.5692,
    ("h100-80gb", "half"): 0.3646,
    ("h200-141gb", "half"): 0.431,
    ("h200-141gb", "tf32"): 0.4042,
}
DERIVED = {("h100-80gb", "tf32"): (("h100-80gb", "half"), ("h200-141gb", "tf32"), ("h200-141gb", "half"))}


def gpu(name: str) -> GPU:
    if name not in CATALOGUE:
        raise ModelError(f"GPU {name!r} is not in the catalogue; known: {', '.join(CATALOGUE)} "
                         "(or give a point you measured on one GPU: [measured])")
    return CATALOGUE[name]


def mode_for(g: GPU, precision: str) -> str:
    """The arithmetic a recipe's train.precision runs at on `g`: fp32 training uses tf32 where the
    GPU has it (cuDNN's default), bf16 the tensor cores' half rate."""
    if precision == "bf16":
        if "half" not in g.peak or g.name in ("v100-16gb", "v100-32gb"):
            raise ModelError(f"train.precision = 'bf16': the {g.name} has no bf16 arithmetic; use fp32")
        return "half"
    return "tf32" if "tf32" in g.peak else "fp32"


def factor(g: GPU, mode: str) -> tuple[float, str]:
    """(achieved-rate factor, where it comes from) of `g` in `mode`."""
    if (g.name, mode) in FACTOR:
        return FACTOR[(g.name, mode)], "fitted"
    if (g.name, mode) in DERIVED:
        own, num, den = DERIVED[(g.name, mode)]
        return FACTOR[own] * FACTOR[num] / FACTOR[den], (f"derived: {own[0]} {own[1]} x {num[0]} "
                                                         f"{num[1]}/{den[1]}, no measured point")
    raise ModelError(f"no measured point for the {g.name} in {mode} mode; give one ([measured])")


def roofline_s(cost: StepCost, g: GPU, mode: str) -> float:
    """Seconds of one step at the bound: each operator at the longer of its FLOPs at peak and its
    bytes at the memory's bandwidth."""
    peak = g.peak[mode]
    return sum(max(o.flops / peak, o.bytes / g.bandwidth) for o in cost.ops)


def host_s(cost: StepCost) -> float:
    """The host's least time for a step: launching each operator that moves data."""
    return LAUNCH_S * sum(1 for o in cost.ops if o.bytes)


def step_s(cost: StepCost, g: GPU, mode: str, achieved: float) -> float:
    return max(roofline_s(cost, g, mode) / achieved, host_s(cost))


def fit(cost: StepCost, g: GPU, mode: str, images_per_s: float) -> float:
    """The factor that makes step_s equal the measured step of cost.batch images."""
    return roofline_s(cost, g, mode) / (cost.batch / images_per_s)
