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

SNAPSHOT asks a shard for its state (the chief, at a checkpoint); the reply
is a header [shard version, k, images] then the values and the k
optimizer-state tensors named by `optim.state_keys`, each the shard's size
(k = 0 before the shard's first update).
"""

from __future__ import annotations

import torch

# strategy.compression: the type a PUSH's gradient and a reply's values travel in (None: float32)
WIRE = {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}
HEADER = 3
PUSH, STOP, SNAPSHOT, PULL, LOST = 0, 1, 2, 3, 4
SYNC, DONE = 1, 2  # reply flags (bits)
ASKED = 2  # reply flags >> ASKED: the requests the point was asked with
TAG_HDR, TAG_VALS, TAG_REPLY_HDR, TAG_REPLY_VALS, TAG_SNAP = 1, 2, 3, 4, 5
TAG_SPLIT = 6  # with pipeline stages: the chief tells each shard the split, before anything else


def header(a: int, b: int, c: int = 0) -> torch.Tensor:
    return torch.tensor([a, b, c], dtype=torch.int64)
