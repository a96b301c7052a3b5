"""A link probe: `python -m scaletrain.twin.probe RANK ADDR PORT CHUNK_BYTES CHUNKS`, one process in each
of two namespaces (selftest.py starts them). Rank 0 hosts the store and sends CHUNKS tensors of
CHUNK_BYTES with torch.distributed (gloo), the job's own transport; rank 1 receives them and prints,
as JSON, the bytes and seconds of all but the first (the connection's start is not the link's rate)."""

from __future__ import annotations

import datetime
import json
import sys
import time

import torch
import torch.distributed as dist


def main(rank: int, addr: str, port: int, chunk: int, chunks: int) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore(addr, port, 2, rank == 0, timeout=datetime.timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    buf = torch.zeros(chunk // 4, dtype=torch.float32)
    t0 = None
    for i in range(chunks):
        if rank == 0:
            dist.send(buf, 1)
        else:
            dist.recv(buf, 0)
            if i == 0:
                t0 = time.perf_counter()
    if rank == 1:
        print(json.dumps({"bytes": chunk * (chunks - 1), "seconds": time.perf_counter() - t0}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
