"""Messages between pushers and PS shards: tensors over torch.distributed, tagged.

A push is a header [version, command] (int64) then the shard's gradient
slice (float32); the reply is a header [shard version, dropped] then the
shard's current values. Tags keep headers and payloads of one pair apart.
"""

from __future__ import annotations

import torch

HEADER = 2
PUSH, STOP = 0, 1
TAG_HDR, TAG_VALS, TAG_REPLY_HDR, TAG_REPLY_VALS = 1, 2, 3, 4


def header(version: int, command: int) -> torch.Tensor:
    return torch.tensor([version, command], dtype=torch.int64)
