"""Job: one process's part of a training job, around a loop that may be the user's own.

The built-in loop (loop.py) and a user's script take the same path:

    with scaletrain.Job.from_env(cfg) as job:
        model, optimizer = job.wrap(MyNet())
        for x, y in job.batches():          # this replica's slice of the recipe's data
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            job.step(loss)                   # the strategy: averaging, the PS, the optimizer step
    print(job.figures())

`wrap` builds the recipe's strategy (strategy.name: strategies/build.py) around the model and
optimizer and resumes them from the run's checkpoint (assembly.py: the parts, in their order);
`step` is the strategy's step followed by what the job does at sync points (evaluation,
checkpoints, a stop asked by a signal or a reached target: tracker.py). The job's progress counts
images applied (schedule.py), so `batches()` ends when its target is reached, for every strategy
alike. `figures()` ends the job and returns its summary (summary.json, written by the chief).

Job.from_env places this process: a single-process config trains here; under torchrun, srun or
the local launcher the process joins the job (a parameter server's process serves its shard and
exits inside from_env); a distributed config started by none of them starts the job's processes
here, each running this same script, and exits with the job's status (launch/supervise.py).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from . import schedule
from .assembly import assemble, compute_timer, loop_module, noise_split
from .comm.end import stop_signals, stopped
from .comm.groups import Context, single
from .comm.liveness import CHECKPOINT
from .compute import Accumulation, hold_grads, keep_freed_memory
from .config import Config
from .data import DataError, Prepare, build_datasets, train_loader
from .device import facts, resolve, setup as setup_kernels
from .ema import Ema
from .errors import REPORTED, ConfigError, RunError
from .job_env import default_run_dir, joining
from .launch import join, supervise
from .metrics import start_up
from .mixing import Mixer
from .noise import half_batch, squared_norm
from .optim import decayed, loss_decay, loss_fn, lr_at
from .proc import env as launch_env
from .resume import newest_checkpoint
from .rundir import prepare_run_dir
from .strategies.base import Tick
from .strategies.traits import entry, images_per_update
from .tracker import Tracker

log = logging.getLogger("scaletrain")


def pick_device(cfg: Config) -> torch.device:
    """The device of a single-process run (a distributed one's comes from its plan)."""
    if resolve(cfg.train.device, facts()) == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def setup_process(cfg: Config) -> None:
    keep_freed_memory()
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    setup_kernels(cfg.train.deterministic)


def make_schedule(cfg: Config, train_images: int) -> schedule.Schedule:
    s = schedule.from_config(cfg, train_images)
    if train_images < s.step_images:
        k = cfg.train.grad_accum_steps
        raise RunError(f"{train_images} training images are fewer than one global batch "
                       f"({s.step_images // cfg.data.batch_size // k} replicas x data.batch_size = "
                       f"{cfg.data.batch_size}{f' x train.grad_accum_steps = {k}' if k > 1 else ''})")
    return s


class Job:
    """This worker's part of the job: wrap the model, give its batches, step, report, end."""

    def __init__(self, cfg: Config, run_dir: str | Path, resume: bool = False, progress: bool = True,
                 ctx: Context | None = None) -> None:
        """A worker of `ctx`'s job (None: the only process). Reads the recipe's data; Job.from_env is
        the constructor for scripts."""
        self.cfg, self.ctx, self.run_dir, self.progress = cfg, ctx or single(), Path(run_dir), progress
        self.resume = prepare_run_dir(self.run_dir, resume, cfg) if not self.ctx.distributed else resume
        self._exits = ExitStack()
        self._joined = False  # joined its job in from_env: its end is this process's (launch/join.py)
        self._script = False  # made by from_env for a script: errors end it as the command line's do
        self._entered = False  # inside `with job:` (stop signals caught, the job ended on leaving)
        self._stopped: BaseException | None = None  # figures()' Stopped, raised again if called again
        setup_process(cfg)
        self.device = torch.device(self.ctx.me.device) if self.ctx.distributed else pick_device(cfg)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # this process's kernels, NCCL and caching allocator on its own GPU
        torch.manual_seed(cfg.train.seed)
        # A manifest's files are checked once a job (data/sources.py): the chief does it unless the launcher did.
        self.train_set, self.test_set, self.classes = build_datasets(cfg, self.run_dir, check=self.ctx.is_chief)
        self.schedule = make_schedule(cfg, len(self.train_set))
        self.strategy = self.tracker = self.tick = self.pipeline = self._module = None
        self.ema: Ema | None = None  # the average of the weights (train.ema_decay), of this process's own
        self.summary: dict[str, Any] | None = None
        self._pending = False  # a batch was given and its step not yet taken
        self._averaging, self._forwards = False, 0  # forwards through wrap()'s module since the last step
        self._images = 0  # the images of the batch given last
        self._split_every, self._half_sq = 0, None  # one replica's noise scale (noise.py: half_batch)
        self._steps = 0  # updates of this process: job.step() calls, or every train.grad_accum_steps-th
        self._accum = Accumulation(cfg.train.grad_accum_steps)  # the micro-batches of an update
        self._calls_only, self._calls = [], 0  # keys only calls of wrap()'s module apply; its calls

    # --- the constructor for scripts ------------------------------------------------------------------

    @classmethod
    def from_env(cls, cfg: Config, run_dir: str | Path | None = None, resume: bool = False,
                 progress: bool = True) -> "Job":
        """This process's Job, wherever it was started (the module doc). run_dir: the run's directory
        (default runs/NAME-TIME; under torchrun or srun every process must be given the same one);
        resume: continue the run in it from its newest checkpoint. Under torchrun with several plan
        nodes, each agent's processes read their node's index from SCALETRAIN_PLAN_NODE. A process
        that the local launcher or a Slurm step started for this script takes the job's config from
        RUN_DIR/config.toml, as its launcher resolved it (the port; a restart's node count)."""
        if not cfg.distributed:
            job = cls(cfg, run_dir or default_run_dir(), resume, progress)
            job._script = True
            return job
        launched = os.environ.get(launch_env.RUN_DIR_ENV)  # a process launch/supervise.py started
        if launched or launch_env.in_torchrun() or launch_env.in_slurm_step():
            try:  # before this process joins: a line and an exit status of its own, as `scaletrain train`'s
                cfg, run_dir, resume, node = joining(cfg, launched, run_dir, resume)
            except REPORTED as e:
                join.exit_now(supervise.report(e, Path(run_dir or ".")))
            ctx = join.join_or_exit(cfg, run_dir, resume, progress, node)
            try:
                job = cls(cfg, run_dir, resume, progress, ctx)
            except BaseException as e:  # noqa: BLE001 - the peers must hear of it, not wait
                join.end_or_exit(ctx, e)
                raise
            job._joined = job._script = True
            return job
        main = sys.modules.get("__main__")
        script = [sys.argv[0], *sys.argv[1:]]
        if not (getattr(main, "__file__", None) and os.path.exists(script[0])
                and os.path.samefile(main.__file__, script[0])):
            raise RunError("a distributed Job.from_env outside torchrun or srun starts its processes by running this "
                           "script again: run it as `python SCRIPT.py ...` (not from -c, a notebook or a shell)")
        sys.exit(supervise.run_script(cfg, Path(run_dir) if run_dir else default_run_dir(), resume, progress,
                                      script))

    # --- the loop's calls -----------------------------------------------------------------------------

    def wrap(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None):
        """(module, optimizer) to train with: the model on this process's device inside the recipe's
        strategy (allreduce: a DistributedDataParallel; forward and backward run through it), and the
        optimizer (None: the recipe's [optim]). Restores both from the run's checkpoint when it
        resumes. A strategy whose parameter servers apply the updates takes no optimizer of the user's:
        the shards step the recipe's [optim]."""
        if self.strategy is not None:
            raise RunError("job.wrap() was called twice: a job trains one model")
        if not self._entered:
            raise RunError("job.wrap() outside `with`: write `with Job.from_env(cfg) as job:`, so that the job "
                           "catches stop signals and ends with its peers whatever ends the loop")
        if not isinstance(model, torch.nn.Module):
            raise RunError(f"job.wrap() takes a torch.nn.Module, not {type(model).__name__}")
        cfg, ctx, device = self.cfg, self.ctx, self.device
        if optimizer is not None and (entry(cfg).uses_ps or cfg.strategy.emulate_workers):
            raise ConfigError(f"strategy.name = {cfg.strategy.name!r}: its parameter servers apply the updates with "
                              "the recipe's [optim]; call job.wrap(model) without an optimizer")
        if optimizer is not None and cfg.parallel.stages > 1:
            raise ConfigError(f"parallel.stages = {cfg.parallel.stages}: each stage steps the recipe's [optim] over its "
                              "own layers; call job.wrap(model) without an optimizer")
        # A replacement takes a live replica's state when it joins (comm/ring.py), never a checkpoint's.
        found = newest_checkpoint(self.run_dir / "checkpoints", cfg, ctx.distributed) if self.resume and not ctx.late \
            else None
        parts = assemble(cfg, ctx, device, self.run_dir, self.classes, self.schedule, model, optimizer, found)
        self.strategy, self.pipeline, self.ema = parts.strategy, parts.pipeline, parts.ema
        prepare = Prepare(cfg.data.augment, self.train_set.stats, device, parts.channels_last)
        self.tracker = t = Tracker(cfg, ctx, self.run_dir, parts.model, self.strategy, self.schedule, prepare,
                                   len(self.train_set), self.test_set, parts.resumed, self.progress, self.pipeline,
                                   self.ema)
        t.compute_time = compute_timer(cfg, ctx.me.node, device, lambda: self._accum.micro == 0)  # a straggler's
        self.tick = Tick(t.images0, False, t.images0 >= self.schedule.target)
        self._decayed = decayed(parts.net)
        parts.model.train()
        if ctx.distributed:
            t.bar.message(start_up("data ready, training"))
        module, self._averaging, self._calls_only = loop_module(cfg, parts, device)
        self._split_every = noise_split(cfg, self.strategy, device, t.not_applied)
        if t.not_applied and ctx.is_chief:
            log.warning("not applied: %s", "; ".join(f"{k} = {v}" for k, v in t.not_applied.items()))
        if self._averaging and not self.pipeline:  # job.forward_backward counts a pipeline's forwards
            module.register_forward_pre_hook(self._forwarded)
        if self._calls_only:  # bf16, compile: in effect only where the loop calls this module
            module.register_forward_pre_hook(self._called)
        self._accum.k = self.strategy.accum  # a replacement's: those of the replica it took its state from
        # The micro-batches of an update add up their gradients: no zeroing between them (after a loss too, where
        # the replicas left accumulate more: cluster.after_loss)
        if cfg.train.grad_accum_steps > 1 or cfg.cluster.after_loss == "keep-batch":
            hold_grads(lambda: self._accum.micro > 0, parts.optimizer, module, parts.net, parts.model,
                       self.strategy.model)
        self._module = module
        return module, parts.optimizer

    def _forwarded(self, module, args) -> None:
        self._forwards += 1

    def _called(self, module, args) -> None:
        self._calls += 1

    def batches(self):
        """This replica's batches as (x, y) on its device, normalised and augmented as the recipe says,
        until the job's target is reached (or a stop: should_stop). Each needs one job.step() before the
        next; with train.grad_accum_steps = k they are micro-batches, k to an update (compute.Accumulation).
        From a resumed checkpoint they go on where it stopped. Under train.emulate_compute_s no data
        is read: each batch is None (compute.Emulated). With train.label_smoothing, data.mixup_alpha or
        data.cutmix_alpha, x is mixed and y is soft targets, N x model.num_classes probabilities, which
        cross_entropy takes as it takes class indices (mixing.py)."""
        self._wrapped("batches")
        cfg, ctx, t = self.cfg, self.ctx, self.tracker
        emulated = bool(cfg.train.emulate_compute_s)
        replica = ctx.plan.replica_of(ctx.me)  # a pipeline's stages share it: they mix their batch alike
        mixer = Mixer(cfg, replica)
        loader = None if emulated else iter(train_loader(  # the loader's steps are micro-batches
            self.train_set, cfg, self.schedule.step_of(self.tick.images) * self._accum.k, None, world=ctx.plan.replicas,
            rank=replica, pin=self.device.type == "cuda")[0])
        try:
            while not self.tick.stop:
                if self._pending:
                    raise RunError(f"step {self.schedule.step_of(self.tick.images)}: the loop asked for the next batch "
                                   "before job.step(loss) of this one; call it once per batch, after loss.backward()")
                t0 = time.perf_counter()
                batch = None if emulated else t.inputs(next(loader))
                t.clock.wait += time.perf_counter() - t0
                if batch is not None and batch[0] is None:
                    if ctx.distributed:  # skipping would leave the other replicas waiting in the step's collective
                        raise DataError("every image of a batch was unreadable (data.on_bad_image = 'skip'); "
                                        "a distributed step needs at least one; see the warnings above")
                    continue
                if mixer.on and batch is not None:  # on the device, keyed by the micro-batch: a resumed run mixes alike
                    batch = mixer(batch, self.schedule.step_of(self.tick.images) * self._accum.k + self._accum.micro)
                self._images = cfg.data.batch_size if emulated else len(batch[1])
                self._pending = True
                if self._accum.k > 1:  # all-reduce the update's gradient in its last micro-batch's backward only
                    self.strategy.sync_backward(self._accum.last)
                t.compute_time.start()
                yield batch
        finally:
            del loader  # stops its worker processes

    @property
    def first_micro(self) -> bool:
        """Whether the batch under way is its update's first micro-batch (train.grad_accum_steps; more after a
        loss under cluster.after_loss = keep-batch)."""
        return self._accum.micro == 0

    @property
    def stages(self) -> int:
        """The pipeline stages a replica is split into (parallel.stages): above 1, a loop's forward and backward
        are job.forward_backward's."""
        return self.cfg.parallel.stages

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The batch's forward and backward, as the built-in loop runs them: its loss (job.loss; on the device,
        no host sync), with .grad holding the gradient. With parallel.stages > 1 they are the pipeline
        schedule's, micro-batch by micro-batch through every stage, and a loop must call this (the module
        job.wrap returns cannot be called on a batch): each stage passes the batch it was given, the first
        using x and the last y (soft targets too: every stage of a replica mixes its batch alike), and gets
        the whole loss."""
        self._wrapped("forward_backward")
        if self.pipeline:
            self._forwards += 1
            return self.pipeline((x, y))[0]
        loss = self.loss(self._module(x), y)  # the module autocasts as the recipe says (compute.around)
        loss.backward()
        return loss.detach()

    def step(self, loss: torch.Tensor | float, lr: float | None = None) -> None:
        """After loss.backward() of the batch batches() gave: the strategy's step (gradients averaged or
        pushed, the optimizer's step, new values pulled), the average of the weights where an update was
        applied (train.ema_decay: ema.py), then the job's sync point when this step is one. loss: the
        batch's loss, for the job's figures (no host sync: it stays on the device).
        lr: this step's learning rate (None: the recipe's schedule, optim.lr and its warm-up and decay)."""
        self._wrapped("step")
        if not self._pending:
            raise RunError("job.step() was called twice for one batch, or before the first: call it once per batch "
                           "of job.batches(), after loss.backward()")
        if all(p.grad is None for p in self.strategy.params):
            raise RunError("job.step(): the model has no gradients; call loss.backward() before job.step()")
        if self._averaging and not self._forwards:
            raise RunError("job.step(): the batch's forward did not run through the module job.wrap() returned, "
                           "whose backward averages the replicas' gradients; call that module, not the network"
                           if not self.pipeline else "job.step(): with parallel.stages > 1 the batch's forward and "
                           "backward are job.forward_backward(x, y)'s; call it before job.step(loss)")
        self._pending, self._forwards = False, 0
        loss = loss.detach() if isinstance(loss, torch.Tensor) else torch.tensor(float(loss))
        update = self._accum.add(loss, self._images, self.strategy.params)
        if update is None:
            self.tracker.compute_time.stop()
            return  # more micro-batches of this update to come: no strategy step, no sync point
        loss, images = update
        self._steps += 1
        if self._half_sq is not None:  # job.loss measured half the batch: the whole batch's gradient is in .grad
            self.strategy.noise.add(self._half_sq, squared_norm(p.grad for p in self.strategy.params))
            self.strategy.noise.step()
            self._half_sq = None
        t, sched = self.tracker, self.schedule
        t.compute_time.stop()
        if lr is None:
            lr = lr_at(self.cfg.optim, sched.step_of(self.tick.images), sched.steps, images_per_update(self.cfg))
        before, self.tick = self.tick, self.strategy.step(lr)
        if self.ema is not None and self.tick.images != before.images:  # an update applied (or pulled): no host sync
            self.ema.update()
        t.after_step(before, self.tick, loss, images, lr)
        if self.strategy.accum != self._accum.k:  # the replicas left keep the global batch (cluster.after_loss)
            self._accum.k = self.strategy.accum
            t.accumulating(self.tick, self._accum.k, self.strategy.members)
        if self.tick.synced:
            self.tick = t.sync_point(self.tick)

    def loss(self, output: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The recipe's loss of a batch, the built-in loop's: cross-entropy plus optim.weight_decay / 2
        times the sum of squares of the weights it decays (optim.decayed: not biases or normalisation
        scales; no such term under adamw, lars and lamb, which decay in the optimizer: optim.loss_decay).
        y: class indices, or the soft targets batches() gives with label smoothing or mixing.
        A loop may use its own; under parameter servers a loss's decay is the only one (the shards'
        optimizer has none of its own). Every train.noise_every steps it also measures the gradient of
        the first half of the batch (noise.half_batch) toward the same targets, soft ones included."""
        self._wrapped("loss")
        wd = loss_decay(self.cfg.optim)
        if self._split_every and self._steps % self._split_every == 0 and output.requires_grad and len(y) >= 2 \
                and not self._accum.micro:  # an update's first micro-batch: measured once an update
            self._half_sq = half_batch(lambda out, lab: loss_fn(out.float(), lab, self._decayed, wd), output, y,
                                       self.strategy.params)
        return loss_fn(output.float(), y, self._decayed, wd)

    @property
    def should_stop(self) -> bool:
        """Whether the job is over: its target reached, or a stop asked (a signal, train.target_*)."""
        return self.tick is not None and self.tick.stop

    def checkpoint(self) -> None:
        """Ask for a checkpoint: every worker takes it together at the next sync point."""
        self.ctx.requests |= CHECKPOINT

    def figures(self) -> dict[str, Any]:
        """End the job (every process together) and return its figures: summary.json's contents on the
        chief, {} on the other workers. Raises errors.Stopped when a stop signal ended it early, after
        its checkpoint. Called again, returns or raises the same. A loop must run job.batches() to its
        end: a replica that left it early would leave the others waiting in the next step's collective."""
        self._wrapped("figures")
        if self._stopped is not None:
            raise self._stopped
        if self.summary is None:
            if not self.tick.stop:
                step = self.schedule.step_of(self.tick.images)
                raise RunError(f"the loop left job.batches() at step {step} of {self.schedule.steps}, before the "
                               "job's end: every replica runs it to its end (train.steps, train.epochs, a target "
                               "reached or a stop)")
            t = self.tracker
            self._not_called()
            if self._split_every and not self.strategy.noise.totals[2] and self._steps >= self._split_every:
                t.not_applied["train.noise_every"] = "no loss went through job.loss, where one replica measures it"
                if self.ctx.is_chief:
                    log.warning("not applied: train.noise_every = %s", t.not_applied["train.noise_every"])
            try:
                self.strategy.finish(stopped=t.stopped)  # after the last snapshot: the PS stop when every pusher is done
            finally:
                t.close()
            self.summary = t.summarize(self.tick, len(self.train_set), len(self.test_set))
            if t.stopped:
                step = self.schedule.step_of(self.tick.images)
                self._stopped = stopped(t.stopped, f"at step {step} of {self.schedule.steps}; the checkpoint of "
                                                   f"step {step} is in {self.run_dir / 'checkpoints'}")
                raise self._stopped
        return self.summary

    # --- the job's lifetime ---------------------------------------------------------------------------

    def __enter__(self) -> "Job":
        self._exits.enter_context(stop_signals(self.ctx, self.cfg.cluster.stopping,
                                               escalate=not self.ctx.distributed))
        self._entered = True
        return self

    def __exit__(self, kind, exc, tb) -> bool:
        """The job ends here: figures() after a loop that ran to its end; after an error, the checkpoint
        being written finishes. A process that joined its job in from_env then ends with its peers (and
        exits, unless the job ended well); a script's own job says a user error in one line and exits
        with the command line's status for it."""
        raised = None
        try:
            if exc is None and self.strategy is not None:
                self.figures()
            elif self.tracker is not None and self.summary is None:
                self.tracker.close()  # nothing half-written: the checkpoint writer finishes
        except BaseException as e:  # noqa: BLE001 - ending the job can fail too (a stop, a lost peer)
            exc = raised = e
        finally:
            self._exits.close()
        if self._joined:
            join.end_or_exit(self.ctx, exc)  # exits this process unless the job ended well
        elif self._script and isinstance(exc, REPORTED):
            sys.exit(supervise.report(exc, self.run_dir))
        if raised is not None:
            raise raised
        return False

    def _not_called(self) -> None:
        """Recorded as not applied: what only the module wrap() returned applies, where no forward of
        the loop called it (it called the network itself, or train.emulate_compute_s ran none)."""
        if not self._steps or self._calls:
            return
        why = "no forward runs under train.emulate_compute_s" if self.cfg.train.emulate_compute_s else \
            "the loop's forwards did not call the module job.wrap() returned"
        for key in self._calls_only:
            self.tracker.not_applied[key] = why
            if self.ctx.is_chief:
                log.warning("not applied: %s = %s", key, why)

    def _wrapped(self, what: str) -> None:
        if self.strategy is None:
            raise RunError(f"job.{what}() before job.wrap(model): the job trains the model it wraps")
