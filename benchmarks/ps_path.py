"""The parameter-server path for a ResNet-50-sized model, against bare send/recv pairs.

2 pushers (2 nodes of 1 replica) and 1-4 PS shards on dedicated nodes, sync,
on this host (processes, gloo over loopback). The model is ResNet-50 (25.6M
parameters, 102 MB of fp32 gradients) on emulated GPUs
(train.emulate_compute_s, a sleep and a fixed gradient), so a step is the
push-pull cycle plus a short compute. Measured:

- scaletrain: `scaletrain train`; the cycle is the job's step (2 x batch
  images over its images/s) less the pushers' compute per step;
- bare: a bare torch.distributed script with the same processes moving the
  same bytes: each pusher sends every shard its slice and receives the
  shard's values back (send/recv pairs), each shard runs one optimizer pass
  over its slice per cycle. A reference, not a floor: scaletrain's path has
  beaten it (ratio 0.66 with 1 shard at b5cc5ab on an H100), so a ratio
  under 1 says the bare script leaves time unused (its shards, for one,
  receive the two pushers' slices one after the other).

Prints one JSON object: seconds per cycle, effective GB/s (the bytes a cycle
moves in and out of the pushers over its seconds) and the ratio to bare.

--device cuda puts the worker side on the GPU (one each while there are two,
else both on GPU 0 with cluster.backend = 'gloo'), as scaletrain runs it: the
gradient on the GPU, one copy of each shard's slice into pinned host memory,
the replies received into pinned memory and copied back to the GPU. The bare
script does the same copies, synchronising the GPU before it sends and before the clock.
The shards stay on CPUs either way.

    python benchmarks/ps_path.py [--shards 1 2 4] [--steps 12] [--compression none] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from scaletrain.launch.local import free_port
from scaletrain.metrics import run_info

import torch

ROOT = Path(__file__).resolve().parents[1]
COMPUTE_S = 0.01
BATCH = 32
# Synthetic data: no image is read (the compute is emulated), and the digits would need scikit-learn.
JOB = ["model.name=resnet50", "model.num_classes=1000", "data.name=synthetic", "data.image_size=32", f"data.batch_size={BATCH}",
       "data.workers=0", f"train.emulate_compute_s={COMPUTE_S}", "train.eval_every=0", "train.checkpoint_every=0",
       "optim.name=sgd", "optim.momentum=0.9", "cluster.nodes=2", "cluster.gpus_per_node=1",
       "cluster.ps_placement=dedicated", "strategy.name=sync", "train.log_every=2"]

# The bare script: ranks 0..P-1 are shards, P and P+1 pushers; `cycles` push-pull cycles, timed after 2.
BARE = r'''
import json, sys, time, torch, torch.distributed as dist
from scaletrain.config import load_config
from scaletrain.optim import build_optimizer
rank, world, port, numel, cycles, recipe = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
cuda = sys.argv[7] == "cuda" and rank >= world - 2  # the pushers' side on a GPU
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
shards, pushers = world - 2, [world - 2, world - 1]
sizes = [(k + 1) * numel // shards - k * numel // shards for k in range(shards)]
if rank < shards:
    w = torch.nn.Parameter(torch.zeros(sizes[rank]))
    opt = build_optimizer(load_config(recipe, ["optim.name=sgd", "optim.momentum=0.9"]).optim, [w])
    acc, buf = torch.empty(sizes[rank]), torch.empty(sizes[rank])
elif not cuda:
    g, vals = torch.randn(numel), [torch.empty(n) for n in sizes]  # kept, as scaletrain keeps its buffers
else:
    dev = torch.device("cuda", (rank - shards) % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    g = torch.randn(numel, device=dev)
    out = [torch.empty(n, pin_memory=True) for n in sizes]  # each shard's slice, on the host
    vals = [torch.empty(n, pin_memory=True) for n in sizes]
    back = [torch.empty(n, device=dev) for n in sizes]  # the replies, on the GPU
for c in range(cycles + 2):
    if c == 2:
        if cuda:
            torch.cuda.synchronize()  # host-device sync before the clock
        dist.barrier()
        t0 = time.perf_counter()
    if rank < shards:
        dist.recv(acc, src=pushers[0])
        dist.recv(buf, src=pushers[1])
        w.grad = acc.add_(buf)
        opt.step()
        for p in pushers:
            dist.send(w.detach(), dst=p)
    elif cuda:
        off = 0
        for k, n in enumerate(sizes):
            out[k].copy_(g[off:off + n], non_blocking=True)
            off += n
        torch.cuda.synchronize()  # host-device sync: the slices are on the host (and last cycle's replies back)
        works = [dist.irecv(v, src=k) for k, v in enumerate(vals)]
        works += [dist.isend(o, dst=k) for k, o in enumerate(out)]
        for x in works:
            x.wait()
        for b, v in zip(back, vals):
            b.copy_(v, non_blocking=True)
    else:
        works = [dist.irecv(v, src=k) for k, v in enumerate(vals)]
        off = 0
        for k, n in enumerate(sizes):
            works.append(dist.isend(g[off:off + n], dst=k))
            off += n
        for x in works:
            x.wait()
if cuda:
    torch.cuda.synchronize()  # host-device sync before the clock
dist.barrier()
if rank == world - 1:
    print(json.dumps((time.perf_counter() - t0) / cycles))
'''


def bare_cycle(shards: int, numel: int, cycles: int, device: str = "cpu") -> float:
    with tempfile.TemporaryDirectory() as d:
        script = Path(d) / "bare.py"
        script.write_text(BARE)
        port, world = str(free_port("127.0.0.1")), shards + 2
        procs = [subprocess.Popen([sys.executable, str(script), str(r), str(world), port, str(numel), str(cycles),
                                   str(ROOT / "recipes/digits.toml"), device], stdout=subprocess.PIPE, text=True)
                 for r in range(world)]
        outs = [p.communicate()[0] for p in procs]
        if any(p.returncode for p in procs):
            raise SystemExit(f"bare send/recv with {shards} shards failed")
        return json.loads(outs[-1])


def scaletrain_cycle(shards: int, steps: int, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as d:
        cmd = [sys.executable, "-m", "scaletrain", "train", "--recipe", str(ROOT / "recipes/digits.toml"),
               "--run-dir", f"{d}/run", "--quiet",
               *sum((["--set", s] for s in [*JOB, f"cluster.num_ps={shards}", f"train.steps={steps + 2}",
                                              "train.warmup_log_steps=2", *extra]), [])]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"scaletrain train with {shards} shards exited {r.returncode}: {r.stderr[-400:]}")
        s = json.loads(Path(f"{d}/run/summary.json").read_text())
    step_s = 2 * BATCH / s["images_per_sec"]
    compute_s = s["time_split_s"]["compute_s"] / s["steps"]
    return {"step_s": step_s, "compute_s": compute_s, "cycle_s": step_s - compute_s,
            "comm_s_per_step": s["time_split_s"]["comm_s"] / s["steps"], "ps_bytes": s["bytes_per_step"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", nargs="+", type=int, default=[1, 2, 4])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--set", dest="sets", action="append", default=[], help="more scaletrain settings")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where the pushers' side runs")
    a = ap.parse_args()
    cuda = a.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit(f"ps_path: --device cuda, but torch {torch.__version__} sees no CUDA GPU")
    # Two emulated nodes on one host: a GPU each, or both on GPU 0 with gloo between them (plan.gpu_map).
    backend = "gloo" if cuda and torch.cuda.device_count() < 2 else "auto"
    where = [f"train.device={a.device}", *([f"cluster.backend={backend}"] if cuda else [])]
    from scaletrain.models import build_model
    from scaletrain.config import ModelConfig

    numel = sum(p.numel() for p in build_model(ModelConfig(name="resnet50", num_classes=1000)).parameters())
    rows = []
    for shards in a.shards:
        ours, bare = [], []
        for _ in range(a.repeats):  # alternating, so the host's spells hit both
            bare.append(bare_cycle(shards, numel, a.steps, a.device))
            ours.append(scaletrain_cycle(shards, a.steps, [*where, *a.sets]))
            print(f"{shards} shards: bare {bare[-1]:.3f} s, scaletrain {ours[-1]['cycle_s']:.3f} s",
                  file=sys.stderr, flush=True)
        cycle, b = statistics.median(o["cycle_s"] for o in ours), statistics.median(bare)
        moved = 2 * numel * 4  # a pusher's gradient out and the values back
        rows.append({"shards": shards, "cycle_s": round(cycle, 4), "bare_s": round(b, 4),
                     "ratio": round(cycle / b, 3), "effective_GBps": round(moved / cycle / 1e9, 3),
                     "bare_GBps": round(moved / b / 1e9, 3), "runs": ours, "bare_runs": bare})
    print(json.dumps({"benchmark": "ps_path", "parameters": numel, "gradient_MB": round(numel * 4 / 1e6, 1),
                      "pushers": 2, "emulated_compute_s": COMPUTE_S, "settings": a.sets, "rows": rows,
                      "max_ratio": max(r["ratio"] for r in rows),
                      **({"pushers_on": "cuda", "cluster_backend": backend} if cuda else {}),
                      **run_info(torch.device("cuda", 0) if cuda else torch.device("cpu"))}, indent=1))


if __name__ == "__main__":
    main()
