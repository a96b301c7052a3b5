"""Which device a process computes on, and which device settings take effect there.

The decisions are pure functions of the facts (GPUs visible, torch's build, what Slurm
allocated), so they are tested on CPU with made-up GPU counts; `facts()` reads the real
ones. Nothing falls back silently (DESIGN.md rule 14): a GPU asked of a host or a torch
that has none is an error naming the fix, and a setting that cannot take effect on the
device is refused when the device is known from the config, or recorded as not applied
(summary.json's `not_applied`, the bench's rows) when it is found at run time.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .errors import PlanError

SETUP_DONE = "SCALETRAIN_SETUP_DONE"  # set by the sbatch script after cluster.setup's lines ran


@dataclass(frozen=True)
class Facts:
    visible: int             # CUDA devices this process sees
    cuda_build: str | None   # torch.version.cuda: None for a CPU build of torch
    torch_version: str
    slurm_gpus: int          # GPUs Slurm allocated to this node of the job (0 outside one, or none)


def slurm_gpus(env=os.environ) -> int:
    """GPUs Slurm gave this node of the job: SLURM_GPUS_ON_NODE, else the ids listed in
    SLURM_STEP_GPUS or SLURM_JOB_GPUS (0 when none, or outside an allocation)."""
    if env.get("SLURM_GPUS_ON_NODE", "").isdigit():
        return int(env["SLURM_GPUS_ON_NODE"])
    ids = env.get("SLURM_STEP_GPUS") or env.get("SLURM_JOB_GPUS") or ""
    count = 0
    for part in (i.strip() for i in ids.split(",") if i.strip()):  # "0,1" or "0-3"
        lo, _, hi = part.partition("-")
        count += int(hi) - int(lo) + 1 if hi.isdigit() and lo.isdigit() else 1
    return count


def facts(env=os.environ) -> Facts:
    """This process's facts."""
    import torch  # heavy: config validation and plans read this module without torch

    # device_count() is 0 on a CPU build and on a CUDA build with no driver; it does not create a context.
    return Facts(torch.cuda.device_count(), torch.version.cuda, torch.__version__, slurm_gpus(env))


def resolve(want: str, f: Facts) -> str:
    """train.device ('auto' | 'cpu' | 'cuda') -> the device type this process computes on."""
    if want == "cpu":
        return "cpu"
    if f.visible:
        return "cuda"
    if f.slurm_gpus and f.cuda_build is None:
        raise PlanError(f"this Slurm allocation gives the node {f.slurm_gpus} GPU{'s' * (f.slurm_gpus > 1)} but torch "
                        f"{f.torch_version} is a CPU build: install a CUDA build of torch in the job's environment, "
                        "or set train.device = 'cpu'")
    if f.slurm_gpus:
        raise PlanError(f"this Slurm allocation gives the node {f.slurm_gpus} GPU{'s' * (f.slurm_gpus > 1)} but CUDA "
                        "sees none (check the driver with nvidia-smi, and CUDA_VISIBLE_DEVICES); or set "
                        "train.device = 'cpu'")
    if want == "cuda":
        why = f"torch {f.torch_version} is a CPU build" if f.cuda_build is None else "no CUDA GPU is visible"
        raise PlanError(f"train.device = 'cuda' but {why}; use train.device = 'auto' or 'cpu'")
    return "cpu"


def gpus_for_plan(want: str, f: Facts) -> int:
    """The GPU count a plan places workers on: those visible, or 0 for CPU workers."""
    return f.visible if resolve(want, f) == "cuda" else 0


def refused(cfg) -> list[str]:
    """Settings that cannot take effect on the device the config names (train.device = 'cpu'):
    one line each, for a ConfigError before anything starts."""
    if cfg.train.device != "cpu":
        return []
    return [f"{key} = {value}: {why}; train.device = 'cpu'" for key, value, why in _cuda_only(cfg)]


def not_applied(cfg, device_type: str, env=os.environ) -> dict[str, str]:
    """Settings that take no effect in this run: key -> why (recorded, warned once). The CUDA-only
    ones on another device, and cluster.setup outside the sbatch script that runs it (which marks
    the environment it makes with SETUP_DONE)."""
    out = {} if device_type == "cuda" else \
        {key: f"{value}: {why}; this run computes on {device_type}" for key, value, why in _cuda_only(cfg)}
    if cfg.cluster.setup and env.get(SETUP_DONE) != "1":
        out["cluster.setup"] = ("run only by the sbatch script of `scaletrain slurm`; this job ran in the "
                                "environment it was started in")
    return out


def _cuda_only(cfg) -> list[tuple[str, object, str]]:
    t = cfg.train
    out = []
    if t.precision == "bf16":
        out.append(("train.precision", "bf16", "bf16 autocast runs on CUDA only"))
    if t.channels_last:
        out.append(("train.channels_last", True, "the channels_last format is used on CUDA only"))
    return out


def setup(deterministic: bool) -> None:
    """Kernel choices of this process. Deterministic mode needs cuBLAS's fixed workspace (set before
    the first cuBLAS call) and refuses every kernel without a deterministic version; the built-in
    models use none (tests/test_device.py checks their ops against torch's list)."""
    import torch  # heavy: config validation and plans read this module without torch

    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    else:
        torch.backends.cudnn.benchmark = True
