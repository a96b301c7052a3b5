"""Messages between pushers and PS shards: tensors over torch.distributed, tagged.

A message to a shard is a header [version, command, flag] (int64); a PUSH
then carries the shard's gradient slice (float32, or the half type of
strategy.compression, as do the replies' values). The flag of a PUSH holds
its sender's requests (comm/liveness.CHECKPOINT, STOP: a stop signal, a
timed checkpoint): the shard makes its next update a sync point (schedule.py),
and every reply of that point carries the requests (ASKED), so all workers act
on the same. The flag of a STOP is the number of the signal that stopped the
job before its end (-1: unknown; 0: it ran to its end). Every PUSH and PULL is
answered with a header [shard version, flags, images applied by the job]
then the shard's current values. Tags keep headers and payloads apart.

Flags of a reply: SYNC, the values are those of a sync point (every pusher
gets these same values, then the workers meet); DONE, the job's target is
reached. PULL asks for the values of the sync point without a gradient: a
pusher sends it to the shards that answered its push before they reached the
point another shard already announced (see ps/server.py).

LOST [rank, LOST, 0] tells a shard that a pusher was lost and the job goes
on without it (the chief sends it when it declares the loss, see
comm/liveness.py): the shard stops waiting for it.

REBUILD [version, REBUILD, k], from the pusher that holds the newest values of a lost
shard k, asks a live shard to take k on (cluster.survive_loss): then [images] and k's values
follow (TAG_REBUILD), and the shard answers [0, REBUILD, k] once it serves k, on k's own tags
(`Tags`: each shard index has its set, so one process can serve several without their
messages meeting).

SNAPSHOT asks a shard for its state (the chief, at a checkpoint); the reply
is a header [shard version, k, images] then the values and the k
optimizer-state tensors named by `optim.state_keys`, each the shard's size
(k = 0 before the shard's first update).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# strategy.compression: the type a PUSH's gradient and a reply's values travel in (None: float32)
WIRE = {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}
HEADER = 3
PUSH, STOP, SNAPSHOT, PULL, LOST, REBUILD = 0, 1, 2, 3, 4, 5
SYNC, DONE = 1, 2  # reply flags (bits)
ASKED = 2  # reply flags >> ASKED: the requests the point was asked with
TAG_HDR, TAG_VALS, TAG_REPLY_HDR, TAG_REPLY_VALS, TAG_SNAP = 1, 2, 3, 4, 5
TAG_SPLIT = 6  # with pipeline stages: the chief tells each shard the split, before anything else
TAG_REBUILD = 7  # a lost shard's values, to the shard that takes it on, and its answer


@dataclass(frozen=True)
class Tags:
    """The tags of one shard's messages: the first shard a process serves has the ones above; a shard it
    took on for a lost one (REBUILD) has its own set, above every other tag."""
    hdr: int = TAG_HDR
    vals: int = TAG_VALS
    reply_hdr: int = TAG_REPLY_HDR
    reply_vals: int = TAG_REPLY_VALS
    snap: int = TAG_SNAP


def tags(shard: int | None = None) -> Tags:
    """The tags of messages to and from shard `shard` as taken on by another (None: a process's own)."""
    if shard is None:
        return Tags()
    base = 16 * (shard + 1)
    return Tags(base + TAG_HDR, base + TAG_VALS, base + TAG_REPLY_HDR, base + TAG_REPLY_VALS, base + TAG_SNAP)


def header(a: int, b: int, c: int = 0) -> torch.Tensor:
    return torch.tensor([a, b, c], dtype=torch.int64)
