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
from .. import stats
from ..config import load_config
from ..data import DataError
from ..models import PretrainedError
from ..strategies import entry, wait_for


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
            serve(cfg, ctx)
        else:
            from ..train import train

            train(cfg, run_dir, resume=resume, progress=progress, ctx=ctx)
    except (DataError, PretrainedError) as e:
        print(f"scaletrain: error: {ctx.describe(rank)}: {e}", file=sys.stderr, flush=True)
        sdist.abort(ctx)
        return 1
    except KeyboardInterrupt:
        sdist.abort(ctx)
        return 130
    except Exception as e:  # noqa: BLE001 - communication errors become one line naming the peer
        if ctx.gone or "Connection" in str(e) or "Timed out" in str(e) or "timeout" in str(e).lower():
            print(f"scaletrain: error: {ctx.lost(e)}", file=sys.stderr, flush=True)
            sdist.abort(ctx)
            return 1
        raise
    sdist.finish(ctx)
    return 0


def serve(cfg, ctx) -> None:
    from ..data import build_datasets
    from ..ps.server import Shard
    from ..train import total_steps

    e = entry(cfg)
    pushers = ctx.plan.leaders if e.per_node else [p.rank for p in ctx.plan.workers]
    train_set, _, _ = build_datasets(cfg)
    per_epoch = len(train_set) // (cfg.data.batch_size * len(ctx.plan.workers))
    shard = Shard(cfg, ctx.me.index, pushers, e.server, wait_for(cfg, len(pushers)), total_steps(cfg, per_epoch))
    shard.serve()
    stats.gather_all(stats.pack(
        ctx.plan.world_size, by_sender=shard.by_sender, is_ps=1, node=ctx.me.node, bytes_sent=shard.bytes_sent, bytes_recv=shard.bytes_recv, steps=shard.applied,
        dropped=shard.dropped, applied=shard.applied, stale_max=shard.stale_max,
        shard_bytes=shard.values.numel() * shard.values.element_size(), pusher=0, hist=shard.hist),
        ctx.plan.world_size)


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
