"""What a job's loop reports to (job.py): the job clock, metrics rows, and what is done at sync points.

At sync points (schedule.py) every worker holds the same values and meets the
others (`Tracker.sync_point`): they evaluate their slices of the test set
together, decide together whether to stop, and the chief checkpoints.

A job that goes on without lost workers (asynchronous PS modes, see
comm/liveness.py) has no collective among its workers: at its sync points the
shards keep the others waiting while the chief alone evaluates (the whole test
set, its replica) and checkpoints; the requests come in the shards' replies,
the same for every worker, and a stop the chief decides reaches the others as
the shards' DONE.
"""

from __future__ import annotations

import logging
import math
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist

from . import checkpoint, stats
from .comm.liveness import CHECKPOINT, STOP
from .data import Batch, DataError, test_loader
from .device import not_applied
from .loggers import Loggers
from .metrics import DeviceTimer, JobClock, Progress, peak_memory, sync
from .replicas import evaluate, replica_buffers
from .optim import state_keys
from .plan import lost_nodes
from .resume import rng_state
from .strategies import traits
from .strategies.base import Tick
from .twin.dilation import cluster_row

log = logging.getLogger("scaletrain")


class Tracker:
    """What the loop reports to: the job clock, metrics rows, and what is done at sync points."""

    def __init__(self, cfg, ctx, run_dir, model, strategy, sched, prepare, train_images, test_set, resumed,
                 progress, pipeline=None, ema=None) -> None:
        """model: the whole network (with stages, the chief's copy that `pipeline` gathers them into);
        ema: the average of this process's weights (ema.py), None without train.ema_decay."""
        self.cfg, self.ctx, self.run_dir, self.model, self.strategy = cfg, ctx, run_dir, model, strategy
        self.pipeline, self.ema = pipeline, ema
        self.sched, self.prepare, self.device, self.chief = sched, prepare, prepare.device, ctx.is_chief
        self.not_applied = not_applied(cfg, self.device.type)  # settings that take no effect in this run
        self.per_epoch = train_images // sched.step_images
        self.resumed_from = str(resumed.path) if resumed else None
        self.best, self.bad = (resumed.best, resumed.bad) if resumed else (None, set())
        # A replacement starts where the replica it took its state from was (comm/ring.py)
        self.images0 = self.last_point = resumed.images if resumed else strategy.images
        self.clock = JobClock(self.images0, cfg.train.warmup_log_steps * sched.step_images)
        self.drains = traits.entry(cfg).server == "async"  # the job's last window is not timed (JobClock)
        self.rec = Loggers(run_dir, cfg.train.loggers) if self.chief else None
        self.writer = checkpoint.Writer(run_dir / "checkpoints", cfg.train.keep_checkpoints) if self.chief else None
        self.bar = Progress(sched.steps, sched.step_of(self.images0), enabled=progress and self.chief,
                            every=cfg.train.log_every)
        # Each replica evaluates its slice (with stages, each of its stages), or the chief all of it where no
        # collective joins the workers. Emulated compute trains on made-up gradients: nothing to evaluate.
        index, slices = (0, 1) if ctx.tolerant else (ctx.plan.replica_of(ctx.me), ctx.plan.replicas)
        self.evaluation = test_loader(test_set, cfg, self.device.type == "cuda", index, slices) \
            if len(test_set) and (self.chief or not ctx.tolerant) and not cfg.train.emulate_compute_s else None
        self.group = None if ctx.tolerant else ctx.job_group  # None when this is the only worker
        self.lost: list[dict] = []  # worker nodes the job went on without (chief)
        self.joined: list[dict] = []  # replacements admitted (chief): summary.json's joined_workers
        self.losses = torch.zeros(2, 2, dtype=torch.float64, device=self.device)  # [since row, since eval] x [sum, n]
        self.final: dict[str, float] = {}
        self.target: dict[str, float] = {}
        self.computed, self.compute_time, self.last_loss = 0, DeviceTimer(self.device), float("nan")
        self.peak = 0  # bytes: this process's peak memory while it trained (metrics.peak_memory)
        self.stopped = 0  # the signal that stopped the job before its end (comm.end.stopped), 0 while it runs
        self.saved_at = 0.0  # job clock of the last checkpoint (train.checkpoint_every_s)

    def inputs(self, batch: Batch):
        """The batch on the device as the network's input, without images that could not be read
        (on_bad_image)."""
        if batch.bad:
            if self.cfg.data.on_bad_image == "error":
                b = batch.bad[0]
                raise DataError(f"{b.path}: cannot read image ({b.reason}); "
                                "set data.on_bad_image = 'skip' to count and skip such files")
            for b in batch.bad:
                if b.path not in self.bad:
                    log.warning("skipping unreadable image %s (%s)", b.path, b.reason)
                self.bad.add(b.path)
        if len(batch.y) == 0:
            return None, None
        return self.prepare(batch)

    def after_step(self, before: Tick, tick: Tick, loss: torch.Tensor, n: int, lr: float) -> None:
        self.computed += n
        # The training's peak memory, read before a sync point's checkpoint adds its serialised copy (a
        # getrusage call, or the allocator's counter: no host-device sync)
        self.peak = peak_memory(self.device)
        self.losses[:, 0] += loss
        self.losses[:, 1] += 1
        if tick.synced or self.sched.crossed(self.cfg.train.log_every, before.images, tick.images):
            sync(self.device)  # host-device sync: the clock must see the queued work
            self.compute_time.seconds()  # reads the steps' events while they are few
            # Async shards end the job at another pusher's push: this tick's window holds the drain after it
            window = self.clock.tick(tick.images, close=True, timed=not (tick.stop and self.drains))
            rate = window[0] / window[1] if window else None
            s, n_ = self.losses[0].tolist()  # host-device sync, at log points only
            self.losses[0].zero_()
            self.last_loss = s / max(n_, 1)
            step = self.sched.step_of(tick.images)
            row = {"images": tick.images, "epoch": self.epoch(tick.images), "wall": self.clock.wall(),
                   "train_wall": self.clock.now(), "loss": self.last_loss, "lr": lr * self.strategy.lr_scale}
            if rate is not None:
                row.update(images_per_sec=rate, data_wait_fraction=window[2] / window[1])
            noise = self.strategy.noise.window() if self.strategy.noise is not None else None
            if noise is not None:
                row["noise_scale"] = noise
            row = cluster_row(row, self.cfg.cluster.time_scale)  # the twin's dilation: the cluster's figures
            if self.rec:
                self.rec.row("train", step, **row)
            self.bar.update(step, self.last_loss, row.get("images_per_sec") or 0.0)
        else:
            self.clock.tick(tick.images, close=False)
        if self.chief and len(self.ctx.dropped_at) > len(self.lost):
            self._note_lost(tick)
        if self.chief and len(self.strategy.joined()) > len(self.joined):
            self._note_joined(tick)
        every = self.cfg.train.checkpoint_every_s
        if self.chief and every and self.clock.wall() - self.saved_at >= every:
            self.ctx.requests |= CHECKPOINT  # the strategy carries it to the next sync point

    def accumulating(self, tick: Tick, k: int, n: int) -> None:
        """Each of the n replicas' updates now take k micro-batches (cluster.after_loss = keep-batch): said by
        the chief."""
        if not self.chief:
            return
        b = self.cfg.data.batch_size
        said = "the recipe's" if n * b * k == self.sched.step_images else \
            f"against the recipe's {self.sched.step_images}; the learning rate follows it"
        said = f"step {self.sched.step_of(tick.images)}: {n} replicas, {k} micro-batch{'es' * (k > 1)} of {b} " \
               f"each: a global batch of {n * b * k} images, {said}"
        self.bar.message(said) if self.bar.enabled else log.info("%s", said)

    def _note_joined(self, tick: Tick) -> None:
        """Record the replacements admitted since the last step (cluster.replacements): as of this step."""
        for j in self.strategy.joined()[len(self.joined):]:
            nodes = lost_nodes(self.ctx.plan, j["ranks"])
            self.joined.append({**nodes, "wall": round(j["t"] - self.clock.t0, 3), "images": tick.images,
                                "step": self.sched.step_of(tick.images), "pause_s": round(j["pause_s"], 3)})
            self.bar.message(f"step {self.sched.step_of(tick.images)}: a replacement joined for node "
                             f"{', '.join(map(str, nodes['nodes']))}, with the chief's state")

    def _note_lost(self, tick: Tick, final: bool = False) -> None:
        """Record the worker nodes the chief declared lost since the last step: when (job clock)
        and how far the job had come (images applied, as of this step). final: at the job's end, those
        the survivors had no step left to re-form after too."""
        for ranks, t, silent in self.ctx.dropped_at[len(self.lost):]:
            healed = self.strategy.healed(len(self.lost))
            if healed is None and not final:  # the survivors have yet to re-form: noted at a later step
                return
            lost = lost_nodes(self.ctx.plan, ranks)  # nodes numbered from 1, as the messages number them
            self.lost.append({**lost, "wall": round(t - self.clock.t0, 3), "detect_s": round(silent, 2),
                              "images": tick.images, "step": self.sched.step_of(tick.images), **(healed or {})})
            step = self.sched.step_of(tick.images)
            if "shard" in (healed or {}):  # a PS shard, which another took on (ps_client.py)
                self.bar.message(f"step {step}: lost PS shard {healed['shard']}; {self.ctx.describe(healed['taken_on_by'])}"
                                 f" took it on at version {healed['version']}")
                continue
            left = self.ctx.plan.worker_nodes - len({n for x in self.lost if "shard" not in x for n in x["nodes"]})
            self.bar.message(f"step {step}: lost node {', '.join(map(str, lost['nodes']))}; "
                             f"going on with {left} worker nodes")

    def epoch(self, images: int) -> float:
        return images / (self.sched.step_images * self.per_epoch)

    def sync_point(self, tick: Tick) -> Tick:
        """A sync point: every worker is here with the same values. Decide together whether to
        evaluate, checkpoint and stop (the job's target, a target accuracy or loss reached, or a stop
        asked of any process), then do it."""
        s, t = self.sched, self.cfg.train
        at_eval = tick.stop or s.crossed(t.eval_every, self.last_point, tick.images)
        job_loss, asked = self._reduce(reset=at_eval)  # collective: returns once every worker has arrived
        if self.ctx.tolerant:  # the shards' replies (or the ring's all-reduce) carried this point's requests
            asked = tick.asked
        self.ctx.requests &= ~(asked & CHECKPOINT)
        stop = tick.stop
        if asked & STOP and not stop:  # stopped before the end: checkpoint, no evaluation
            self.ctx.requests |= STOP
            self.stopped = self._agreed_signal()
            self.bar.message(f"step {s.step_of(tick.images)}: stop asked: checkpointing and stopping")
            stop = True
        save = stop or asked & CHECKPOINT or s.crossed(t.checkpoint_every, self.last_point, tick.images)
        self.last_point = tick.images
        at = self.clock.t  # the point is where this tick reached it
        if at_eval and not self.stopped:
            self.clock.pause()  # evaluation is not training time
            res = self._evaluate(tick, at)
            self.clock.resume()
            reached = (t.target_accuracy and res.get("test_accuracy", 0.0) >= t.target_accuracy) or \
                (t.target_loss and job_loss <= t.target_loss and (self.chief or not self.ctx.tolerant))
            if reached and not self.target:
                self.target = {"time_to_target": at, "images_to_target": tick.images,
                               "steps_to_target": s.step_of(tick.images)}
                self.bar.message(f"step {s.step_of(tick.images)}: target reached; stopping")
                stop = save = True
        if self.ctx.tolerant and not tick.stop:  # the chief alone evaluated: who stops with it
            stop = self.strategy.agree_stop(stop)
        if save:
            self._checkpoint(tick, final=stop)
            self.saved_at = self.clock.wall()
        return Tick(tick.images, True, stop)

    def _reduce(self, reset: bool) -> tuple[float, int]:
        """Mean train loss of every replica since the last evaluation, and the requests
        (CHECKPOINT, STOP) any of them holds."""
        r = self.ctx.requests
        sums = torch.cat([self.losses[1], torch.tensor([r & CHECKPOINT, r & STOP], dtype=torch.float64,
                                                       device=self.device)])
        if self.group is not None:
            dist.all_reduce(sums, group=self.group)  # collective over the workers
        if reset:
            self.losses[1].zero_()
        total, n, checkpoint_, stop = sums.tolist()
        return (total / n if n else math.nan), (CHECKPOINT if checkpoint_ else 0) | (STOP if stop else 0)

    def _agreed_signal(self) -> int:
        """The stop signal, as one of the workers got it (the others may have heard only of the
        stop); -1 when none knows which."""
        num = torch.tensor([self.ctx.stop_signal], device=self.device)
        if self.group is not None:
            dist.all_reduce(num, op=dist.ReduceOp.MAX, group=self.group)  # collective: all stop here
        self.ctx.stop_signal = int(num) or -1
        return self.ctx.stop_signal

    def _evaluate(self, tick: Tick, at: float) -> dict[str, float]:
        if self.evaluation is None:
            return {}
        with self.strategy.latest():
            res = self._test()
            if self.ema is not None:  # the average's figures beside the weights': a second pass over the test set
                with self.ema.swapped():
                    avg = self._test()
                res.update({f"{k}_ema": avg[k] for k in ("test_accuracy", "test_loss") if k in avg})
        if res:
            self.final = res
            self.best = max(self.best or 0.0, res["test_accuracy"])
            step = self.sched.step_of(tick.images)
            if self.rec:
                self.rec.row("eval", step, **cluster_row(dict(images=tick.images, epoch=self.epoch(tick.images),
                                                              train_wall=at, **res), self.cfg.cluster.time_scale))
            self.bar.message(f"step {step}: test accuracy {res['test_accuracy']:.4f}  loss {res['test_loss']:.4f}"
                             + (f"  (average of the weights: {res['test_accuracy_ema']:.4f})"
                                if "test_accuracy_ema" in res else ""))
        return res

    def _test(self) -> dict[str, float]:
        """The test set's figures of the model as it holds its values now (every worker's slice, or the chief's
        whole test set where no collective joins the workers)."""
        p = self.pipeline
        return evaluate(p.module if p else self.model, self.evaluation, self.device, self.inputs, self.group,
                        self.ctx.plan.replicas, self.cfg.train.precision, p and self.ctx.workers_group,
                        p and p.forward)

    def _ema_state(self) -> dict | None:
        """The average of the weights for the chief's checkpoint and model-ema.safetensors, by the names of the
        model's state_dict (None elsewhere). With stages, every stage's average is gathered into the chief's copy
        of the model, then copied out: the values' gather that follows puts the weights back there.
        Point-to-point over replica 0's stages, as the values' gather."""
        if self.pipeline is None:
            return self.ema.state_dict() if self.chief else None
        with self.ema.swapped():
            self.pipeline.gather()
            whole = {k: v.detach().clone() for k, v in self.model.state_dict().items()} if self.chief else None
        return {"updates": self.ema.updates, "tensors": whole} if self.chief else None

    def _checkpoint(self, tick: Tick, final: bool) -> None:
        """The chief takes every shard's state while the others wait, with every replica's
        BatchNorm statistics (each replica keeps its own between evaluations, so a resumed job goes
        on exactly as an uninterrupted one), then copies it for its writer thread (the previous
        write done first); training goes on while it is written. final: the job's last one."""
        with self.strategy.latest() if self.chief else nullcontext():
            p, opt = self.pipeline, self.strategy.optimizer
            ema = self._ema_state() if self.ema is not None else None  # before the values' gather (_ema_state)
            whole = p.gather(opt, state_keys(self.cfg.optim)) if p else None  # the other stages' values and state
            state = {"step": self.sched.step_of(tick.images), "images": tick.images,
                     "model": self.model.state_dict(), "optimizer": whole or opt.state_dict(),
                     "rng": rng_state(), "config": self.cfg.flat(), "best_test_accuracy": self.best,
                     "bad": sorted(self.bad), **self.strategy.snapshot(), **({"ema": ema} if ema else {}),
                     **({"pipeline_split": p.split} if p else {})} if self.chief else None
            if self.group is not None:
                # Collective over the workers; it is also the barrier: no pusher moves on before the
                # shards' state is taken.
                buffers = replica_buffers(self.strategy.model, self.group, len(self.ctx.plan.workers),
                                          self.ctx.plan.workers[0].rank, self.chief, p and p.buffer_numel,
                                          self.strategy.replica_state())
                if self.chief:
                    state["replica_buffers"] = p.by_stage(buffers) if p else buffers
            if self.chief:
                self.writer.submit(state["step"], state, final=final)

    def _pipeline(self, job: dict) -> dict:
        """The split and its measured figures, each stage's beside the bubble a schedule has by its
        formula, (S - 1) / (M + S - 1) of its time idle."""
        if self.pipeline is None:
            return {}
        p, measured = self.pipeline, job.pop("pipeline", [{}] * self.pipeline.S)
        return {"pipeline": {"schedule": self.cfg.parallel.schedule, "microbatches": p.M,
                             "bubble_formula": (p.S - 1) / (p.M + p.S - 1),
                             "stages": [{**a, **b} for a, b in zip(p.describe(), measured)]}}

    def close(self) -> None:
        self.bar.close()
        if self.rec:
            self.rec.close()
        if self.writer:
            self.writer.join()  # the process must not exit halfway through a checkpoint
            if not self.writer.ended:  # the run failed before its end: room for its last words (summarize's else)
                self.writer.release()

    def summarize(self, tick: Tick, train_images: int, test_images: int) -> dict[str, Any]:
        """Gather every process's figures; the chief writes model.safetensors and summary.json."""
        c = self.strategy.counters
        mine = dict(node=self.ctx.me.node, computed=self.computed, own_s=self.clock.t, bytes_sent=c.bytes_sent,
                    bytes_recv=c.bytes_recv, intra_bytes=c.intra_bytes, steps=c.steps,
                    compute_s=self.compute_time.seconds(), intra_s=c.intra_s, comm_s=c.comm_s, pusher=self.strategy.pusher, stopped_at=tick.images,
                    peak_mem=self.peak, weights_sum=sum(float(q.detach().double().sum()) for q in self.strategy.params),
                    **self.strategy.figures(), **(self.pipeline.figures() if self.pipeline else {}))
        job = stats.job_figures(self.ctx, mine) if self.ctx.distributed else stats.single_figures(mine)
        if self.chief:  # declared after the last step
            self._note_lost(tick)
        ema = self._ema_state() if self.ema is not None else None  # for model-ema.safetensors
        if self.pipeline:  # the other stages' final values into the chief's model, for model.safetensors
            self.pipeline.gather()
        try:
            if self.writer:
                self.writer.finish()  # a run whose last checkpoint is not on disk failed, whatever ended it
            if not self.chief or self.stopped:  # a stopped run is not over: its checkpoint is its record
                return {}
            if ema is not None:
                checkpoint.write_weights(self.run_dir / "model-ema.safetensors", ema["tensors"],
                                         "the final average of the weights")
            return self._write_summary(tick, job, train_images, test_images)
        finally:
            if self.writer:  # kept through the weights' write: room for the last words of a job that fails in it
                self.writer.release()

    def _write_summary(self, tick: Tick, job: dict[str, Any], train_images: int,
                       test_images: int) -> dict[str, Any]:
        """model.safetensors and summary.json (the chief)."""
        self._note_lost(tick, final=True)
        self._note_joined(tick)
        for row, measured in zip(self.joined, self.strategy.joined(final=True)):  # what each replacement measured
            row.update({k: round(measured[k], 3) for k in ("start_s", "wait_s", "adopt_s") if k in measured})
        return stats.write_summary(self.run_dir, self.model, {
            "steps": self.sched.step_of(tick.images), "epochs": self.epoch(tick.images),
            "wall_seconds": self.clock.wall(), "eval_seconds": self.clock.paused,
            **self.clock.summary(), "images_computed": job.pop("images_computed"),
            "final_train_loss": self.last_loss, "test_accuracy": self.final.get("test_accuracy"),
            "test_loss": self.final.get("test_loss"), "best_test_accuracy": self.best,
            **({"test_accuracy_ema": self.final.get("test_accuracy_ema"), "test_loss_ema": self.final.get(
                "test_loss_ema"), "ema_updates": self.ema.updates} if self.ema is not None else {}),
            "target_reached": bool(self.target), **self.target,
            "skipped_images": len(self.bad), "skipped_files": sorted(self.bad)[:20],
            "lost_workers": self.lost, "joined_workers": self.joined, "resumed_from": self.resumed_from, "start_step": self.sched.step_of(self.images0),
            "train_images": train_images, "test_images": test_images,
            "emulated_compute_s": self.cfg.train.emulate_compute_s,
            # The gradient noise scale over the run (noise.py); None where none was measured
            "noise_scale": self.strategy.noise.overall if self.strategy.noise is not None else None,
            "not_applied": self.not_applied, **self._pipeline(job)}, self.cfg, self.ctx, self.device, job,
            self.strategy.stats())
