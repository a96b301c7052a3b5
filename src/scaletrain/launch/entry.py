"""What every process of a distributed job runs: join, take a role, work, report.

Reads RANK and WORLD_SIZE from the environment (set by the local launcher,
torchrun or srun) and the resolved config from RUN_DIR/config.toml.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

import torch

from .. import dist as sdist
from .. import checkpoint, stats
from ..config import load_config
from ..data import DataError
from ..models import PretrainedError
from ..strategies import entry, wait_for
from ..train import RunError, total_steps, train


def run(run_dir: Path, resume: bool, progress: bool) -> int:
    cfg = load_config(run_dir / "config.toml")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if not cfg.train.threads:
        torch.set_num_threads(int(os.environ.get("SCALETRAIN_THREADS", "1")))
    strat = entry(cfg)
    (run_dir / "logs").mkdir(exist_ok=True)
    (run_dir / "logs" / f"rank{rank}.pid").write_text(f"{os.getpid()}\n")  # for operators and failure tests
    ctx = sdist.init(cfg, rank, world, strat.uses_ps)
    try:
        if ctx.me.role == "ps":
            serve(cfg, ctx, run_dir, resume)
        else:
            train(cfg, run_dir, resume=resume, progress=progress, ctx=ctx)
    except (DataError, PretrainedError, RunError, checkpoint.CheckpointError) as e:
        print(f"scaletrain: error: {ctx.describe(rank)}: {e}", file=sys.stderr, flush=True)
        sdist.abort(ctx)
        return 1
    except KeyboardInterrupt:
        sdist.abort(ctx)
        return 130
    except Exception as e:  # noqa: BLE001 - a lost peer's error becomes one line naming it
        lost = ctx.lost(e)
        if lost is None:
            raise
        print(f"scaletrain: error: {lost}", file=sys.stderr, flush=True)
        sdist.abort(ctx)
        return 1
    sdist.finish(ctx)
    return 0


def serve(cfg, ctx, run_dir: Path, resume: bool) -> None:
    from ..ps.server import Shard

    e = entry(cfg)
    pushers = ctx.plan.leaders if e.per_node else [p.rank for p in ctx.plan.workers]
    total = cfg.train.steps
    if not total:  # the schedule's length comes from the epoch size; only then is the data read
        from ..data import build_datasets

        per_epoch = len(build_datasets(cfg)[0]) // (cfg.data.batch_size * len(ctx.plan.workers))
        total = total_steps(cfg, per_epoch)
    shard = Shard(cfg, ctx.me.index, pushers, e.server, wait_for(cfg, len(pushers)), total)
    found = checkpoint.load_latest(run_dir / "checkpoints") if resume else None
    if found is not None:  # the workers load the same file and check its config
        state, path = found
        shards = state.get("ps") or []
        if ctx.me.index >= len(shards):
            raise checkpoint.CheckpointError(f"{path} holds {len(shards)} parameter-server shards; "
                                             f"this run has {cfg.cluster.num_ps}")
        shard.load(shards[ctx.me.index])
        logging.getLogger("scaletrain").info("PS shard %d resumed from %s at version %d", ctx.me.index, path,
                                             shard.version)
    shard.serve()
    stats.gather_all(stats.pack(
        ctx.plan.world_size, is_ps=1, node=ctx.me.node, pusher=0, steps=shard.applied, applied=shard.applied,
        bytes_sent=shard.bytes_sent, bytes_recv=shard.bytes_recv, dropped=shard.dropped,
        stale_max=shard.stale_max, shard_bytes=shard.values.numel() * shard.values.element_size(),
        hist=shard.hist, by_sender=shard.by_sender), ctx.plan.world_size)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scaletrain.launch.entry")
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--quiet", action="store_true")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s rank {os.environ.get('RANK')}: %(message)s")
    return run(a.run_dir, a.resume, not a.quiet)


if __name__ == "__main__":
    sys.exit(main())
