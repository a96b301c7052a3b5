"""Messages between pushers and PS shards: tensors over torch.distributed, tagged.

A push is a header [version, command] (int64) then the shard's gradient
slice (float32); the reply is a header [shard version, dropped] then the
shard's current values. Tags keep headers and payloads of one pair apart.

SNAPSHOT asks a shard for its state (the chief sends it between two of its
steps, for a checkpoint); the reply is a header [shard version, k] then the
values and the k optimizer-state tensors named by `optim.state_keys`, each
the shard's size (k = 0 before the shard's first update).
"""

from __future__ import annotations

import torch

HEADER = 2
PUSH, STOP, SNAPSHOT = 0, 1, 2
TAG_HDR, TAG_VALS, TAG_REPLY_HDR, TAG_REPLY_VALS, TAG_SNAP = 1, 2, 3, 4, 5


def header(version: int, command: int) -> torch.Tensor:
    return torch.tensor([version, command], dtype=torch.int64)
