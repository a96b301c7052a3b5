"""The built-in training loop: the recipe's network, batch -> forward/backward -> job.step.

It is a Job's loop like any user's (job.py): the job runs until its target
is reached (schedule.py: images whose gradients were applied, the same unit
for every strategy), or a target accuracy or loss is, and does at its sync
points what tracker.py says. What the built-in loop adds: the recipe's
network (models/), its loss with weight decay (job.loss), and emulated compute
(train.emulate_compute_s: compute.Emulated). Precision and torch.compile are
job.wrap's, in the module it returns, as a user's loop gets them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .comm.groups import Context
from .compute import Backprop, Emulated
from .config import Config
from .job import Job
from .models import build_model


def train(cfg: Config, run_dir: str | Path, resume: bool = False, progress: bool = True,
          ctx: Context | None = None) -> dict[str, Any]:
    """Run the worker loop of this process; returns the summary (the chief writes it, the other
    workers return {}). Raises Stopped when a stop signal ended the job early (after its checkpoint)."""
    with Job(cfg, run_dir, resume, progress, ctx) as job:
        forward, opt = job.wrap(build_model(cfg.model))
        if cfg.train.emulate_compute_s:  # an emulated GPU: no data read, a fixed gradient (compute.py)
            compute = Emulated(cfg, job.strategy.model, job.device, lambda: job.first_micro)
        elif job.pipeline:  # the replica's stages: the pipeline schedule's forwards and backwards
            compute = lambda batch: (job.forward_backward(*batch), len(batch[1]))  # noqa: E731
        else:
            compute = Backprop(cfg, forward, opt, job.loss)
        for batch in job.batches():
            loss, _ = compute(batch)  # forward and backward: .grad holds this replica's gradient
            job.step(loss)
        return job.figures()
