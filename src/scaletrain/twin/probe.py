"""A link probe: one process in a node's namespace, forked by selftest.py from a process that imported
torch already (a probe is up in milliseconds, not the seconds of an import). Pairs of probes meet
over torch.distributed (gloo), the job's own transport: rank 0 hosts the pair's store and sends
CHUNKS tensors of CHUNK bytes; rank 1 receives them and reports the bytes and seconds of all but the
first (the connection's start is not the link's rate). Both say `ready` once they met, and send
when told to: every pair of a test sends at once, as a job's nodes do. Lines on pipes carry that
talk with the parent; the data goes over the twin's links only."""

from __future__ import annotations

import datetime
import json
import os
import time

import torch
import torch.distributed as dist

from ..proc.parent import die_with_parent
from .netns import IFNAME, enter


def fork(ns: str, rank: int, addr: str, port: int, chunk: int, chunks: int) -> tuple[int, int, int]:
    """Start a probe in namespace ns: (pid, fd it writes its lines to, fd it reads `go` from)."""
    up_r, up_w = os.pipe()
    down_r, down_w = os.pipe()
    parent = os.getpid()
    pid = os.fork()
    if pid:
        os.close(up_w)
        os.close(down_r)
        return pid, up_r, down_w
    code = 1
    try:
        os.close(up_r)
        os.close(down_w)
        die_with_parent(parent)  # a killed parent takes its probes with it
        enter(ns)
        os.environ["GLOO_SOCKET_IFNAME"] = IFNAME
        # Its failure comes back as a line on the pipe; c10d's warnings (no reverse DNS for the twin's
        # addresses, which no resolver knows) would only clutter the launcher's terminal.
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 2)
        os.close(null)
        with os.fdopen(up_w, "w") as out, os.fdopen(down_r) as go:
            try:
                _run(rank, addr, port, chunk, chunks, out, go)
                code = 0
            except BaseException as e:  # noqa: BLE001 - told to the parent as one line
                out.write(f"error {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}\n")
                out.flush()
    except BaseException:  # noqa: BLE001 - before the pipe was there: the parent sees the pipe close
        pass
    os._exit(code)


def _run(rank: int, addr: str, port: int, chunk: int, chunks: int, out, go) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore(addr, port, 2, rank == 0, timeout=datetime.timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    buf = torch.zeros(chunk // 4, dtype=torch.float32)
    dist.barrier()
    out.write("ready\n")
    out.flush()
    go.readline()
    t0 = None
    for i in range(chunks):
        if rank == 0:
            dist.send(buf, 1)
        else:
            dist.recv(buf, 0)
            if i == 0:
                t0 = time.perf_counter()
    seconds = time.perf_counter() - t0 if rank == 1 else 0.0
    dist.barrier()
    dist.destroy_process_group()
    out.write(json.dumps({"bytes": chunk * (chunks - 1), "seconds": seconds}) + "\n")
    out.flush()
