"""Point-to-point messages: one process sends a tensor, one receives it (the parameter servers'
traffic, ps/protocol.py), waited for as long as the peer needs.

A *work* is torch's handle of an operation that runs in the background (torch.distributed.Work:
what isend, irecv and a collective with async_op=True return); waiting for it blocks until the
operation is done. gloo's sends and receives keep the timeout of the group they were made with
(the start-up's, cluster.timeout_s) unless the wait says otherwise: here it is OPERATION_TIMEOUT,
days. A healthy peer may take any time (an evaluation, a checkpoint to a slow file system);
whether it is alive is the heartbeats' to judge (liveness.py), not a time limit on its work.
"""

from __future__ import annotations

import datetime

import torch.distributed as dist

OPERATION_TIMEOUT = datetime.timedelta(days=7)  # a healthy collective or receive: no limit below hours


def wait(work) -> None:
    """Wait for a work (a send or receive in flight) as long as the peer needs."""
    work.wait(OPERATION_TIMEOUT)


def send(t, dst: int, tag: int) -> None:
    wait(dist.isend(t, dst=dst, tag=tag))


def irecv(t, src: int | None = None, tag: int = 0):
    """A receive into `t` (from any rank when src is None), posted now: gloo's threads fill `t` from
    when the sender sends. Returns its work: `wait` for it, `source` names the sender."""
    return dist.irecv(t, src=src, tag=tag)


def source(work) -> int:
    """The sender of a receive posted from any rank, once it is done."""
    return work._source_rank()


def recv(t, src: int | None = None, tag: int = 0) -> int:
    """Receive into `t` (from any rank when src is None); returns the sender's rank."""
    work = irecv(t, src, tag)
    wait(work)
    return source(work) if src is None else src
