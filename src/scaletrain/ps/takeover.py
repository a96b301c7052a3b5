"""A PS shard taking on a lost one (cluster.survive_loss; strategies/ps_client.py, ps/protocol.py: REBUILD).

The shard that takes it on builds a second shard of the lost index, starts it from the values a
pusher sends (the newest any pusher holds, at their version) and from the lost shard's optimizer
state in the newest complete checkpoint, and serves it on a thread of its own with that index's
tags; the process's figures then sum both.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import torch

from .. import checkpoint
from ..comm import p2p
from ..errors import CheckpointError
from ..optim import state_keys
from . import protocol as P

log = logging.getLogger("scaletrain")


def take_on(host, src: int, version: int, k: int) -> tuple:
    """REBUILD at shard `host`: serve lost shard k too, from the values `src` holds of it, at their version,
    with the optimizer state of k the newest checkpoint saved; on a thread of its own, with k's tags
    (protocol.py). Returns (the shard, its thread)."""
    images = torch.zeros(1, dtype=torch.int64)
    p2p.recv(images, src=src, tag=P.TAG_REBUILD)
    shard = type(host)(host.cfg, k, host.pushers, host.mode, host.wait_for, host.schedule, host.push_images,
                       host.update_images, host.ctx, tags=P.tags(k), run_dir=host.run_dir)
    values = torch.empty(shard.values.shape)
    p2p.recv(values, src=src, tag=P.TAG_REBUILD)
    saved_step = rebuild(shard, values, version, int(images), host.lost)
    thread = threading.Thread(target=shard.serve, name=f"ps-shard-{k}", daemon=True)
    thread.start()
    # The version whose optimizer state it starts from (-1: none): the updates since are lost; an optimizer
    # without state (sgd without momentum) loses none
    stateful = bool(state_keys(host.cfg.optim))
    p2p.send(P.header(shard.rebuilt["checkpoint_version"] if stateful else version, P.REBUILD, k), dst=src,
             tag=P.TAG_REBUILD)
    log.warning("PS shard %d: took on lost shard %d at version %d, its optimizer state %s", host.index, k, version,
                "(none)" if not stateful else "fresh (no checkpoint)" if saved_step is None else
                f"of the checkpoint of step {saved_step}")
    return shard, thread


def rebuild(shard, values: torch.Tensor, version: int, images: int, lost: set) -> int | None:
    """Start `shard` as the lost one of its index from a pusher's values of it at `version` (the job's
    `images` then), with its optimizer state of the newest checkpoint that holds it (none: fresh), without
    the pushers lost; returns that checkpoint's step (None: none)."""
    with torch.no_grad():
        shard.values.copy_(values)
    for w in shard.sent.values():
        w.copy_(values)
    shard.version, shard.images = version, images
    shard.lost, shard.active = set(lost), shard.active - set(lost)
    saved, step = saved_shard(shard.run_dir, shard.index, shard.values.numel())
    if saved is not None and saved["optimizer"]:
        shard.optimizer.load(saved["optimizer"], shard.version)
    shard.rebuilt = {"version": version, "checkpoint_step": step,
                     "checkpoint_version": saved["version"] if saved is not None else -1}
    return step


def saved_shard(run_dir: Path | None, k: int, numel: int) -> tuple[dict | None, int | None]:
    """Shard k's state in the newest checkpoint of the run that holds it, and that checkpoint's step; read
    as it is (a checkpoint being written is not complete yet: list_complete leaves it out)."""
    for step, path in reversed(checkpoint.list_complete(run_dir / "checkpoints") if run_dir else []):
        try:
            shards = checkpoint.read(path).get("ps") or []
        except CheckpointError:
            continue
        if k < len(shards) and shards[k]["values"].numel() == numel:
            return shards[k], step
    return None, None


def figures(shards: list) -> dict:
    """The figures of the shards one process served (its own, and those it took on), summed."""
    hist, by_sender = sum(s.hist for s in shards), {}
    for s in shards:
        for r, (total, n) in s.by_sender.items():
            by_sender[r] = [by_sender.get(r, [0, 0])[0] + total, by_sender.get(r, [0, 0])[1] + n]
    return dict(steps=sum(s.applied for s in shards), applied=sum(s.applied for s in shards),
                bytes_sent=sum(s.bytes_sent for s in shards), bytes_recv=sum(s.bytes_recv for s in shards),
                dropped=sum(s.dropped for s in shards), stale_max=max(s.stale_max for s in shards),
                shard_bytes=sum(s.values.numel() * s.values.element_size() for s in shards),
                hist=hist, by_sender=by_sender)
