"""Device paths whose logic runs on a CPU: the choices the GPU paths make, and what they keep on
gloo (DDP's gradient buckets, the emulated GPU's order of sync and sleep)."""

from __future__ import annotations

import torch

from scaletrain import compute, metrics
from scaletrain.compute import Emulated
from scaletrain.config import load_config

def test_emulated_gpu_syncs_before_it_sleeps(monkeypatch):
    """The previous step's queued work finishes before the sleep that stands for this step's compute
    (a spy: CUDA cannot run here; tests/gpu shows it with queued kernels)."""
    calls = []
    real_sync, real_sleep = metrics.sync, compute.time.sleep
    monkeypatch.setattr(metrics, "sync", lambda d: (calls.append(("sync", d)), real_sync(d))[1])
    monkeypatch.setattr(compute.time, "sleep", lambda s: (calls.append(("sleep", s)), real_sleep(s))[1])
    cfg = load_config(None, ["train.emulate_compute_s=0.01"])
    work = Emulated(cfg, torch.nn.Linear(3, 2), torch.device("cpu"))
    work(work.fetch())
    assert calls == [("sync", torch.device("cpu")), ("sleep", 0.01)]
