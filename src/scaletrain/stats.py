"""Per-process figures gathered at the end of a distributed run, and the run's summary.

Each process packs its figures into one float64 vector of fixed layout and
the world all-gathers them (one gloo collective; no pickled objects; in a
job that goes on without lost workers, rank 0 collects them from the store). The
job's throughput and time are not among them: those come from the chief's
job clock (metrics.JobClock). What is summed here is work (images computed,
bytes); what is listed per process is labelled so.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save

from .checkpoint import write_file
from .comm.end import store_gather
from .metrics import run_info
from .twin.dilation import cluster_figures

HIST_BINS = 64  # the histograms' bins (staleness, gradients per update): 0..62, the last holds 63 and above
FIELDS = ("is_ps", "node", "computed", "own_s", "bytes_sent", "bytes_recv", "intra_bytes", "steps",
          "compute_s", "intra_s", "comm_s", "dropped", "applied", "stale_max", "shard_bytes", "pusher",
          "stopped_at", "stage", "busy_s", "pipe_s", "act_sent", "peak_mem", "weights_sum")


def pack(world_size: int, **values) -> torch.Tensor:
    """[fields..., staleness histogram, gradients-per-update histogram, per-sender staleness
    sums, per-sender counts]."""
    n, h = len(FIELDS), HIST_BINS
    vec = torch.zeros(n + 2 * h + 2 * world_size, dtype=torch.float64)
    for k, v in values.items():
        if k == "hist":
            vec[n:n + h] = v.double()
        elif k == "update_hist":
            vec[n + h:n + 2 * h] = v.double()
        elif k == "by_sender":  # PS: {sender rank: (staleness sum, count)}
            for r, (total, count) in v.items():
                vec[n + 2 * h + r], vec[n + 2 * h + world_size + r] = total, count
        else:
            vec[FIELDS.index(k)] = float(v)
    return vec


def gather(ctx, values: dict) -> list[dict]:
    """Every process's figures, each with its rank: a collective over the whole world, PS
    included; through the store, on rank 0 only, in a job that goes on without lost workers
    (their rows are missing)."""
    vec = pack(ctx.plan.world_size, **values)
    if ctx.tolerant:
        got = store_gather(ctx, "figures", vec.numpy().tobytes())
        return [unpack(r, torch.frombuffer(bytearray(b), dtype=torch.float64), ctx.plan.world_size)
                for r, b in sorted(got.items())]
    out = [torch.zeros_like(vec) for _ in range(ctx.plan.world_size)]
    dist.all_gather(out, vec)  # collective over the whole world, PS included
    return [unpack(r, v, ctx.plan.world_size) for r, v in enumerate(out)]


def unpack(rank: int, v: torch.Tensor, world_size: int) -> dict:
    n, h = len(FIELDS), HIST_BINS
    return dict(zip(FIELDS, v[:n].tolist()), rank=rank, hist=v[n:n + h].long(), update_hist=v[n + h:n + 2 * h].long(),
                stale_sum=v[n + 2 * h:n + 2 * h + world_size], stale_count=v[n + 2 * h + world_size:])


def job_figures(ctx, mine: dict) -> dict:
    rows = gather(ctx, mine)
    return summarize(rows, ctx.plan.worker_nodes) if rows else {}


def single_figures(mine: dict) -> dict:
    return {"images_computed": mine["computed"], "peak_memory_bytes": mine["peak_mem"],
            "time_split_s": {k: mine[k] for k in ("compute_s", "intra_s", "comm_s")}}


def percentile(hist: torch.Tensor, q: float) -> int:
    total = int(hist.sum())
    if total == 0:
        return 0
    cum = torch.cumsum(hist, 0)
    return int(torch.searchsorted(cum, torch.tensor(q * total, dtype=cum.dtype)).item())


def summarize(rows: list[dict], nodes: int) -> dict:
    """Job-wide figures from every process's row."""
    workers = [r for r in rows if not r["is_ps"]]
    ps = [r for r in rows if r["is_ps"]]
    pushers = [r for r in workers if r["pusher"]]
    out = {
        # dropped gradients' images included; with stages, every stage of a replica computes its batch: once
        "images_computed": int(sum(r["computed"] for r in workers if not r["stage"])),
        "peak_memory_bytes": int(max(r["peak_mem"] for r in workers)),  # the largest worker's (metrics.peak_memory)
        "time_split_s": {k: sum(r[k] for r in workers) / len(workers) for k in ("compute_s", "intra_s", "comm_s")},
        "bytes_per_step": {
            "worker_sent": _mean(r["bytes_sent"] / max(r["steps"], 1) for r in workers),
            "worker_recv": _mean(r["bytes_recv"] / max(r["steps"], 1) for r in workers),
            "intra_node": _mean(r["intra_bytes"] / max(r["steps"], 1) for r in workers),
        },
    }
    if not ps and any(int(w["hist"].sum()) for w in workers):  # staleness counted by the replicas (async-allreduce, local steps)
        hist = sum(w["hist"] for w in workers)
        out.update(**_staleness(hist, _last(hist)), dropped_gradients=0, dropped_fraction=0.0)
        if "update_hist" in workers[0]:  # async-allreduce's rounds (local steps have none)
            updates = workers[0]["update_hist"]  # every replica applies every update: one replica's count
            out.update(gradients_per_update_mean=_mean_of(updates),
                       gradients_per_update_hist=updates.tolist()[:_last(updates) + 1])
    if ps:
        ssum, scount = sum(r["stale_sum"] for r in ps), sum(r["stale_count"] for r in ps)
        for w in workers:
            if scount[w["rank"]] > 0:
                w["staleness_mean"] = float(ssum[w["rank"]] / scount[w["rank"]])
        out.update(_staleness(sum(r["hist"] for r in ps), int(max(r["stale_max"] for r in ps))))
        sizes = [r["shard_bytes"] for r in ps]
        moved = [int(r["bytes_sent"] + r["bytes_recv"]) for r in ps]
        out.update({
            # every shard sees every push: the shard that dropped most counts the node gradients lost
            "dropped_gradients": int(max(r["dropped"] for r in ps)),
            "dropped_fraction": max(float(r["dropped"] / max(1, r["dropped"] + r["stale_count"].sum())) for r in ps),
            "shard_bytes": {"max": max(sizes), "mean": sum(sizes) / len(sizes),
                            "max_over_mean": max(sizes) * len(sizes) / sum(sizes)},
            # what the shards sent and received, counted as it went: the load their layout makes
            "shard_traffic": {"max_over_mean": max(moved) * len(moved) / max(sum(moved), 1)},
            # PS traffic (both directions) of one node in one of its steps (pushers step at their own pace)
            "ps_bytes_per_node_step": sum((r["bytes_sent"] + r["bytes_recv"]) / max(r["steps"], 1)
                                          for r in pushers) / nodes,
        })
        # a PS's traffic per update it applied
        out["bytes_per_step"]["ps_sent"] = _mean(r["bytes_sent"] / max(r["steps"], 1) for r in ps)
        out["bytes_per_step"]["ps_recv"] = _mean(r["bytes_recv"] / max(r["steps"], 1) for r in ps)
    if any(r["stage"] for r in workers):
        out["pipeline"] = pipeline_figures(workers)
    # Per process: its own steps, and the images it computed over its own training time.
    out["per_worker"] = [{"rank": w["rank"], "node": int(w["node"]), "steps": int(w["steps"]),
                          "computed_images_per_sec": w["computed"] / w["own_s"] if w["own_s"] > 0 else 0.0,
                          "stopped_at_images": int(w["stopped_at"]),
                          # the float64 sum of its parameters at its end: one figure where replicas hold one model
                          "weights_sum": w["weights_sum"],
                          **({"staleness_mean": w["staleness_mean"]} if "staleness_mean" in w else {})}
                         for w in workers]
    return out


def pipeline_figures(workers: list[dict]) -> list[dict]:
    """Each stage's figures over its replicas: the fraction of the schedules' time it was idle (the
    bubble), the bytes of activations and gradients it sent a step, its peak memory (the largest)."""
    stages = sorted({int(r["stage"]) for r in workers})
    out = []
    for s in stages:
        rows = [r for r in workers if int(r["stage"]) == s]
        total = sum(r["pipe_s"] for r in rows)
        out.append({"stage": s + 1, "idle_fraction": 1 - sum(r["busy_s"] for r in rows) / total if total else None,
                    "activation_bytes_per_step": _mean(r["act_sent"] / max(r["steps"], 1) for r in rows),
                    "peak_memory_bytes": int(max(r["peak_mem"] for r in rows))})
    return out


def _staleness(hist: torch.Tensor, top: int) -> dict:
    """The job's staleness figures from its histogram and its largest staleness (which may lie
    beyond the last bin)."""
    return {"staleness_mean": _mean_of(hist), "staleness_p50": percentile(hist, 0.5),
            "staleness_p95": percentile(hist, 0.95), "staleness_max": top,
            "staleness_hist": hist.tolist()[:max(1, top + 1)]}


def _mean_of(hist: torch.Tensor) -> float:
    """The mean of the values a histogram counts (bin i holds value i); 0 when it is empty."""
    n = int(hist.sum())
    return float((hist * torch.arange(len(hist))).sum()) / n if n else 0.0


def _last(hist: torch.Tensor) -> int:
    """The last bin with a count (0 when none has)."""
    return int(hist.nonzero().max()) if int(hist.sum()) else 0


def _mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else 0.0


def write_summary(run_dir: Path, model: torch.nn.Module, fields: dict, cfg, ctx, device, job: dict,
                  strategy_stats: dict) -> dict:
    """The chief's model.safetensors and summary.json (each written atomically; a file that
    does not fit is CheckpointError, one line naming it and the bytes it needs)."""
    write_file(run_dir / "model.safetensors",
               save({k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}), "the final weights")
    c = cfg.cluster
    summary = {
        **fields, "model": cfg.model.name, "parameters": sum(p.numel() for p in model.parameters()),
        "strategy": cfg.strategy.name, "nodes": c.nodes, "gpus_per_node": c.gpus_per_node, "num_ps": c.num_ps,
        "ps_placement": c.ps_placement, "replicas": ctx.plan.replicas, "nodes_total": ctx.plan.nodes_total,
        "stages": ctx.plan.stages,
        **run_info(device), **job, **strategy_stats,
    }
    if c.network == "netns":  # the cluster twin's figures, at the cluster's speed
        summary = cluster_figures(summary, c.time_scale, run_dir)
    write_file(run_dir / "summary.json", (json.dumps(summary, indent=2) + "\n").encode(), "the summary")
    return summary
