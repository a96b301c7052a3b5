"""The job's progress and its sync points, in images whose gradients were applied.

Every strategy counts progress the same way: a run of S steps ends when
S x (replicas x data.batch_size x train.grad_accum_steps) images have been
applied, however many updates that takes (all-reduce and sync: S; backup: more,
each update applies N-b nodes' batches; the asynchronous modes: one update per
push). A job step is one global batch of applied images, the images of one
update of every replica: with gradient accumulation, k micro-batches of each
replica (train.grad_accum_steps = k; the loop still calls job.step once per
micro-batch). The learning-rate schedule, the evaluation and checkpoint
cadences and the stop are functions of it.

A sync point is a job step where every worker holds the same parameters and
meets the others, to evaluate, checkpoint or stop together: a multiple of
train.eval_every or train.checkpoint_every job steps, the target, or the step
where a request (a stop signal, a timed checkpoint; comm/liveness.py) is acted
on. The strategies bring every worker there (Tick.synced): a parameter-server
shard applies nothing more from the first update that reaches a point until
every pusher has its values (ps/server.py); all-reduce replicas reach it
together.

Pure arithmetic: no torch, no communication.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Schedule:
    step_images: int          # images of one job step: replicas x data.batch_size x train.grad_accum_steps
    steps: int                # job steps to run: the target is steps x step_images images
    eval_every: int = 0       # job steps between evaluations (0 = only at the end)
    checkpoint_every: int = 0  # job steps between checkpoints (0 = only at the end)
    log_every: int = 10       # job steps between metrics rows

    @property
    def target(self) -> int:
        return self.steps * self.step_images

    def step_of(self, images: int) -> int:
        return images // self.step_images

    def next_point(self, images: int) -> int:
        """The first sync point after `images` (the target at the latest) that the cadences make."""
        points = [self.target] + [(images // c + 1) * c for c in self._cadences() if c]
        return min(points)

    def _cadences(self) -> tuple[int, ...]:
        return tuple(e * self.step_images for e in (self.eval_every, self.checkpoint_every) if e)

    def crossed(self, every: int, before: int, after: int) -> bool:
        """Whether a multiple of `every` job steps lies in (before, after] images."""
        if not every:
            return False
        c = every * self.step_images
        return after // c > before // c


def job_steps(train_steps: int, epochs: float, train_images: int, step_images: int) -> int:
    """train.steps, or train.epochs over the training set in job steps."""
    return train_steps or max(1, math.ceil(epochs * (train_images // step_images)))


def step_images(cfg) -> int:
    """Images of one job step of cfg: replicas x data.batch_size x train.grad_accum_steps (an update's)."""
    return cfg.cluster.nodes * cfg.cluster.gpus_per_node // cfg.parallel.stages * cfg.data.batch_size \
        * cfg.train.grad_accum_steps


def from_config(cfg, train_images: int) -> Schedule:
    """The job's schedule: replicas x batch x micro-batches per job step, the run's length, its cadences."""
    t = cfg.train
    per_step = step_images(cfg)
    return Schedule(per_step, job_steps(t.steps, t.epochs, train_images, per_step),
                    t.eval_every, t.checkpoint_every, t.log_every)
