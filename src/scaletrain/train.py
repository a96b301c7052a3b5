"""The training loop of one process: batch -> forward/backward -> update -> metrics."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from . import checkpoint, stats
from .config import Config, dump_toml
from .dist import Context, single
from .data import Batch, DataError, build_datasets, test_loader, train_loader
from .metrics import Progress, Recorder, rate_stats, run_info, sync
from .models import build_model
from .optim import build_optimizer, decayed, loss_fn, lr_at
from .strategies import build_strategy

log = logging.getLogger("scaletrain")


class RunError(RuntimeError):
    """A run that cannot start or continue; str() says why in one line."""


def pick_device(cfg: Config) -> torch.device:
    want = cfg.train.device
    if want == "cuda" and not torch.cuda.is_available():
        raise RunError("train.device = 'cuda' but no CUDA device is visible; use 'auto' or 'cpu'")
    if want == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def setup_process(cfg: Config) -> None:
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    if cfg.train.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    else:
        torch.backends.cudnn.benchmark = True


def total_steps(cfg: Config, steps_per_epoch: int) -> int:
    return cfg.train.steps or max(1, math.ceil(cfg.train.epochs * steps_per_epoch))


def evaluate(model: torch.nn.Module, loader, device: torch.device, policy: str, bad: set[str]) -> dict[str, float]:
    model.eval()
    loss_sum, correct, n = torch.zeros((), device=device), torch.zeros((), device=device), 0
    with torch.no_grad():
        for batch in loader:
            x, y = _usable(batch, policy, bad, device)
            if x is None:
                continue
            logits = model(x).float()
            loss_sum += torch.nn.functional.cross_entropy(logits, y, reduction="sum")
            correct += (logits.argmax(1) == y).sum()
            n += len(y)
    model.train()
    if n == 0:
        return {}
    # .item(): host-device sync, once per evaluation.
    return {"test_loss": loss_sum.item() / n, "test_accuracy": correct.item() / n, "test_images": n}


def _usable(batch: Batch, policy: str, bad: set[str], device: torch.device):
    if batch.bad:
        if policy == "error":
            b = batch.bad[0]
            raise DataError(f"{b.path}: cannot read image ({b.reason}); "
                            "set data.on_bad_image = 'skip' to count and skip such files")
        for b in batch.bad:
            if b.path not in bad:
                log.warning("skipping unreadable image %s (%s)", b.path, b.reason)
            bad.add(b.path)
    if len(batch.y) == 0:
        return None, None
    return batch.x.to(device, non_blocking=True), batch.y.to(device, non_blocking=True)


def prepare_run_dir(run_dir: Path, resume: bool, cfg: Config) -> None:
    """Checks made before any process starts, then the directory."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if not resume and checkpoint.list_complete(run_dir / "checkpoints"):
        raise RunError(f"{run_dir} already holds checkpoints of a run; pass --resume to continue it "
                       "or choose another --run-dir")


def train(cfg: Config, run_dir: str | Path, resume: bool = False, progress: bool = True,
          ctx: Context | None = None) -> dict[str, Any]:
    """Run the worker loop of this process; returns the summary (the chief writes it)."""
    ctx = ctx or single()
    chief = ctx.is_chief
    run_dir = Path(run_dir)
    if not ctx.distributed:  # a launcher checked it before starting the processes
        prepare_run_dir(run_dir, resume, cfg)
    setup_process(cfg)
    device = pick_device(cfg) if ctx.me.device == "cpu" or not ctx.distributed else torch.device(ctx.me.device)
    torch.manual_seed(cfg.train.seed)
    train_set, test_set, classes = build_datasets(cfg)
    model = build_model(cfg.model).to(device)
    if cfg.train.channels_last and device.type == "cuda":
        model = model.to(memory_format=torch.channels_last)
    opt = build_optimizer(cfg.optim, model.parameters())
    global_batch = cfg.data.batch_size * len(ctx.plan.workers)
    per_epoch = len(train_set) // global_batch
    if per_epoch == 0:
        raise RunError(f"{len(train_set)} training images are fewer than one global batch "
                       f"({len(ctx.plan.workers)} replicas x data.batch_size = {cfg.data.batch_size})")
    total = total_steps(cfg, per_epoch)

    start, best, bad, resumed_from, state = 0, None, set(), None, None
    if resume:
        found = checkpoint.load_agreed(run_dir / "checkpoints", ctx.distributed)
        if found is None:
            log.warning("--resume: no checkpoint in %s; starting from step 0", run_dir / "checkpoints")
        else:
            state, path = found
            diff = checkpoint.config_differences(state["config"], cfg.flat())
            if diff:
                raise RunError(f"{path} was written with another config; differing keys: "
                               + ", ".join(f"{k} ({state['config'].get(k)!r} -> {cfg.flat().get(k)!r})" for k in diff))
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])
            checkpoint.set_rng_state(state["rng"])
            start, best, bad, resumed_from = state["step"], state["best_test_accuracy"], set(state["bad"]), str(path)
            log.info("resumed from %s at step %d", path, start)
    if chief:
        (run_dir / "config.toml").write_text(dump_toml(cfg))
        (run_dir / "classes.txt").write_text("\n".join(classes) + "\n")

    pin = device.type == "cuda"
    replicas = len(ctx.plan.workers)
    loader, _ = train_loader(train_set, cfg, start, total, world=replicas, rank=ctx.me.index, pin=pin)
    strategy = build_strategy(cfg, ctx, model, opt)
    if state is not None:
        strategy.restore(state)
        del state
    evaluation = test_loader(test_set, cfg, pin) if len(test_set) else None
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16)
                if cfg.train.precision == "bf16" and device.type == "cuda" else nullcontext())
    wd_params = decayed(model)
    policy, t = cfg.data.on_bad_image, cfg.train
    rec = Recorder(run_dir, tensorboard=chief, extra={"rank": ctx.rank} if ctx.distributed else None)
    bar = Progress(total, start, enabled=progress and chief, every=t.log_every)
    slow = cfg.strategy.slow_delay_s if ctx.me.node == cfg.strategy.slow_node else 0.0
    info = run_info(device)

    def save_checkpoint(step: int) -> None:
        with strategy.latest():
            checkpoint.save(run_dir / "checkpoints", step, {
                "step": step, "model": model.state_dict(), "optimizer": opt.state_dict(),
                "rng": checkpoint.rng_state(), "config": cfg.flat(), "best_test_accuracy": best,
                "bad": sorted(bad), **strategy.snapshot()}, keep=t.keep_checkpoints)

    def run_eval(step: int) -> dict[str, float]:
        nonlocal best, eval_s
        if evaluation is None or not chief:
            return {}
        t0 = time.perf_counter()
        with strategy.latest():
            res = evaluate(model, evaluation, device, policy, bad)
        if res:
            best = max(best or 0.0, res["test_accuracy"])
            rec.row("eval", step, epoch=step / per_epoch, train_wall=t0 - t_start - eval_s, **res)
            bar.message(f"step {step}: test accuracy {res['test_accuracy']:.4f}  loss {res['test_loss']:.4f}")
        eval_s += time.perf_counter() - t0
        return res

    # Throughput is measured over windows between log points, with the device
    # synchronised at each end; the first `warmup_log_steps` are left out.
    win_images, win_seconds, win_wait, last_loss, compute_s = [], [], [], float("nan"), 0.0
    eval_s = 0.0  # evaluation time: left out of throughput windows and of train_wall
    t_start = time.perf_counter()
    mark, mark_step, wait, images, loss_acc, n_loss = None, start, 0.0, 0, torch.zeros((), device=device), 0
    it = iter(loader)
    model.train()
    try:
        for step in range(start, total):
            if step == start + min(t.warmup_log_steps, total - start - 1):
                sync(device)
                mark, mark_step, wait, images = time.perf_counter(), step, 0.0, 0
            t0 = time.perf_counter()
            batch = next(it)
            wait += time.perf_counter() - t0
            x, y = _usable(batch, policy, bad, device)
            if x is None:
                continue
            if cfg.train.channels_last and device.type == "cuda":
                x = x.contiguous(memory_format=torch.channels_last)
            lr = lr_at(cfg.optim, step, total)
            t1 = time.perf_counter()
            with autocast:
                loss = loss_fn(model(x).float(), y, wd_params, cfg.optim.weight_decay)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if slow:
                time.sleep(slow)  # testing only: an emulated straggler
            if ctx.distributed:
                sync(device)  # host-device sync, so compute time is not charged to communication
            compute_s += time.perf_counter() - t1
            strategy.step(lr)
            images += len(y)
            loss_acc += loss.detach()
            n_loss += 1
            done = step + 1
            if done % t.log_every == 0 or done == total:
                sync(device)  # host-device sync: the clock must see the queued work
                now = time.perf_counter()
                last_loss = loss_acc.item() / max(n_loss, 1)
                row = {"epoch": done / per_epoch, "wall": now - t_start, "train_wall": now - t_start - eval_s,
                       "loss": last_loss, "lr": lr}
                if mark is not None and now > mark and done > mark_step:
                    win_images.append(images)
                    win_seconds.append(now - mark)
                    win_wait.append(wait)
                    row.update(images_per_sec=images / (now - mark), data_wait_fraction=wait / (now - mark))
                    mark, mark_step, wait, images = now, done, 0.0, 0
                rec.row("train", done, **row)
                bar.update(done, last_loss, row.get("images_per_sec", 0.0))
                loss_acc.zero_()
                n_loss = 0
            if t.eval_every and done % t.eval_every == 0 and done != total:
                run_eval(done)
                if mark is not None:  # the next throughput window starts after the evaluation
                    mark, mark_step, wait, images = time.perf_counter(), done, 0.0, 0
            if chief and t.checkpoint_every and done % t.checkpoint_every == 0 and done != total:
                save_checkpoint(done)
        final = run_eval(total)
        if chief:
            save_checkpoint(total)
        strategy.finish()  # after the last snapshot: the PS stop when every pusher has finished
    finally:
        bar.close()
        rec.close()
        del it  # stops loader worker processes

    rate = rate_stats(win_images, win_seconds)
    c = strategy.counters
    job = {}
    if ctx.distributed:
        rows = stats.gather_all(stats.pack(
            ctx.plan.world_size, node=ctx.me.node, images=sum(win_images), timed_s=sum(win_seconds), bytes_sent=c.bytes_sent,
            bytes_recv=c.bytes_recv, intra_bytes=c.intra_bytes, steps=c.steps, compute_s=compute_s,
            intra_s=c.intra_s, comm_s=c.comm_s, pusher=strategy.pusher), ctx.plan.world_size)
        job = stats.summarize(rows, cfg.cluster.nodes)
    if not chief:
        return {}
    from safetensors.torch import save_file

    tmp = run_dir / "model.safetensors.tmp"
    save_file({k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}, str(tmp))
    os.replace(tmp, run_dir / "model.safetensors")
    wall = time.perf_counter() - t_start
    summary = {
        "steps": total, "epochs": total / per_epoch, "wall_seconds": wall,
        "train_seconds": wall - eval_s, "eval_seconds": eval_s,
        **rate,
        "data_wait_fraction": sum(win_wait) / sum(win_seconds) if win_seconds else None,
        "final_train_loss": last_loss,
        "test_accuracy": final.get("test_accuracy"), "test_loss": final.get("test_loss"),
        "best_test_accuracy": best,
        "skipped_images": len(bad), "skipped_files": sorted(bad)[:20],
        "resumed_from": resumed_from, "start_step": start,
        "train_images": len(train_set), "test_images": len(test_set),
        "model": cfg.model.name, "parameters": sum(p.numel() for p in model.parameters()),
        "strategy": cfg.strategy.name, "nodes": cfg.cluster.nodes, "gpus_per_node": cfg.cluster.gpus_per_node,
        "num_ps": cfg.cluster.num_ps, "ps_placement": cfg.cluster.ps_placement, "replicas": replicas,
        "nodes_total": ctx.plan.nodes_total,
        **info,
        **job,
        **strategy.stats(),
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary

