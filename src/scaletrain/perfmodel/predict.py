"""Predicted figures of a configuration: throughput, speedup, efficiency, where time goes.

All-reduce uses the closed form (costs.py); async-allreduce (rounds of as
many gradients as compute makes while a ring runs, uneven speeds) and every
parameter-server configuration use the event simulation (simulate.py): shards that share
links, one-thread shards whose replies overlap the first pushers' next
compute, asynchronous shards, backups and uneven speeds are beyond a closed
form. Speedup and efficiency are scaling.py's, as for a bench:
throughput over that of one node with no distribution (scaling.BASELINE: the
same replicas per node, averaging inside the node only), and speedup over
the nodes used, dedicated PS nodes included.
"""

from __future__ import annotations

import math
import random
from dataclasses import replace
from typing import Any

from . import scaling
from .bands import shown
from ..config import Config
from ..strategies import images_per_update
from . import costs
from .profile import Profile, accumulated, at_batch, memory_at
from .setup import Setup, make_setup
from .simulate import simulate

def expected_max(p: Profile, n: int, spread: float, samples: int = 4000, seed: int = 0) -> float:
    """Mean of the slowest of n replicas' compute times (all-reduce waits for it)."""
    if not spread or n <= 1:
        return p.compute_s
    rng, sigma = random.Random(seed), math.sqrt(math.log1p(spread ** 2))
    draws = (max(rng.lognormvariate(-sigma ** 2 / 2, sigma) for _ in range(n)) for _ in range(samples))
    return p.compute_s * sum(draws) / samples


def estimate(p: Profile, st: Setup, spread: float = 0.0, seed: int = 0) -> tuple[costs.Estimate, str]:
    """The step estimate and the method that made it ('closed form' or 'simulation').
    A training process that loads its own batches does so in series with compute, so that
    time joins compute_s; background loaders set a floor under the step (costs.loader_floor).
    parts keeps compute and input apart."""
    if not p.input_rate and not p.read_rate:
        return _estimate(p, st, spread, seed)
    fed = p if st.loaders else replace(p, compute_s=p.compute_s + costs.input_s(p, st))
    est, method = _estimate(fed, st, spread, seed)
    est.parts.update(compute=p.compute_s, input=costs.input_s(p, st))
    return est, method


def _estimate(p: Profile, st: Setup, spread: float, seed: int) -> tuple[costs.Estimate, str]:
    if st.rounds:
        return _rounds(p, st, spread, seed), "simulation"
    if st.stages > 1:
        return costs.pipeline_allreduce(p, st), "closed form"
    if not st.uses_ps:
        n = st.nodes * st.replicas
        # Local steps too: their request flag, every step, keeps the replicas within a step of the slowest
        slowest = expected_max(p, n, spread, seed=seed) + (st.slow_delay_s if st.slow_node >= 0 else 0.0)
        return costs.allreduce(p, st, wait=slowest - p.compute_s), "closed form"
    closed = costs.sync_ps(p, st)  # the one-shard synchronous round; several shards share links
    uneven = spread > 0 or (st.slow_node >= 0 and st.slow_delay_s > 0)
    sim = simulate(p, st, spread=spread, seed=seed, cycle_hint=closed.step_s)
    even = sim if not uneven else simulate(p, replace(st, slow_node=-1), seed=seed, cycle_hint=closed.step_s)
    images = st.nodes * st.replicas * p.batch_per_replica
    est = costs.Estimate(
        step_s=images / sim.images_per_sec, images_per_step=images,
        parts={"compute": p.compute_s, "intra-node": sim.intra_s,
               "communication": max(0.0, sim.step_s - sim.compute_s - sim.intra_s)},
        ps_cpu_util=sim.ps_cpu_util, link_util=sim.link_util, link_bytes=sim.link_bytes,
        staleness_mean=sim.staleness_mean, staleness_p95=sim.staleness_p95, dropped_fraction=sim.dropped_fraction,
        straggler_s=max(0.0, sim.step_s - even.step_s) if uneven else 0.0)
    return est, "simulation"


def _rounds(p: Profile, st: Setup, spread: float, seed: int) -> costs.Estimate:
    """Async-allreduce, simulated: the closed form's parts and links at the simulated rate, with
    the simulated distributions of staleness and of the gradients an update averages."""
    closed = costs.async_allreduce(p, st)
    sim = simulate(p, st, spread=spread, seed=seed, cycle_hint=closed.step_s)
    per_round = sim.gradients_per_update / (st.nodes * st.replicas)
    images = st.nodes * st.replicas * p.batch_per_replica
    links = {k: v * closed.gradients_per_update / sim.gradients_per_update for k, v in closed.link_bytes.items()}
    est = costs.Estimate(images / sim.images_per_sec, images,
                         {**closed.parts, "optimizer": p.optimizer_s / per_round}, link_bytes=links,
                         staleness_mean=sim.staleness_mean, staleness_p95=sim.staleness_p95)
    est.link_util = max((b / p.net_bandwidth / est.step_s for b in links.values()), default=0.0)
    est.gradients_per_update = sim.gradients_per_update
    return est


def bottleneck(est: costs.Estimate, uses_ps: bool) -> tuple[str, dict[str, float]]:
    """The busiest of compute, input (the loaders), intra-node, network (all-reduce between nodes)
    or PS network (the busiest link), PS CPU and stragglers, by the fraction of the step each
    keeps busy; with the fractions."""
    share = {"compute": est.parts.get("compute", 0.0) / est.step_s,
             **({"input": est.parts["input"] / est.step_s} if "input" in est.parts else {}),
             "intra-node": est.parts.get("intra-node", 0.0) / est.step_s,
             "PS network" if uses_ps else "network": est.link_util,
             "PS CPU": est.ps_cpu_util, "straggler": est.straggler_s / est.step_s,
             **{k: est.parts[k] / est.step_s for k in ("bubble", "activations") if k in est.parts}}
    return max(share, key=share.get), share


def single_node(cfg: Config) -> Config:
    """The study's baseline (scaling.BASELINE): one node, all-reduce, no parameter server, no slow node."""
    return cfg.replace(**scaling.baseline_sets(cfg.flat()))


def predict(cfg: Config, p: Profile, spread: float = 0.0, seed: int = 0) -> dict[str, Any]:
    """One row of predicted figures, keyed like a bench row where the meaning is the same, for
    the recipe's batch per replica (raises ModelError when it does not fit the device)."""
    st = make_setup(cfg, p)
    p = at_batch(p, cfg.data.batch_size, st.stages, st.held / st.microbatches)
    p = accumulated(p, cfg.train.grad_accum_steps)  # a step is an update: k micro-batches' compute and images
    est, method = estimate(p, st, spread, seed)
    # The baseline on the same hardware: its replicas are as uneven as this configuration's.
    base, _ = estimate(p, make_setup(single_node(cfg), p), spread, seed)
    scaled = scaling.scaling(est.images_per_sec, 0.0, base.images_per_sec, 0.0, st.nodes_total)
    name, share = bottleneck(est, st.uses_ps)
    c = cfg.cluster
    return {"strategy": cfg.strategy.name, "nodes": c.nodes, "nodes_total": st.nodes_total,
            "gpus_per_node": c.gpus_per_node, "num_ps": c.num_ps,
            "ps_placement": c.ps_placement if c.num_ps else None, "replicas": c.nodes * st.replicas,
            "stages": st.stages, "microbatches": st.microbatches if st.stages > 1 else None,
            "stage_memory": memory_at(p, p.batch_per_replica, st.stages, st.held / st.microbatches)
            if st.stages > 1 else None,
            "backup_workers": cfg.strategy.backup_workers, "batch_per_replica": cfg.data.batch_size,
            "grad_accum_steps": cfg.train.grad_accum_steps, "update_batch": images_per_update(cfg), "spread": spread,
            "images_per_sec": est.images_per_sec, "step_s": est.step_s, "speedup": scaled["speedup"],
            "efficiency": scaled["efficiency"], "baseline_images_per_sec": base.images_per_sec,
            "parts_s": est.parts, "link_bytes_per_step": est.link_bytes, "ps_cpu_util": est.ps_cpu_util,
            "link_util": est.link_util, "busy": share, "bottleneck": name,
            "staleness_mean": est.staleness_mean, "staleness_p95": est.staleness_p95,
            "dropped_fraction": est.dropped_fraction, "method": method,
            **({"gradients_per_update": est.gradients_per_update} if st.rounds else {})}


def applied_rate(row: dict[str, Any]) -> float:
    """Images per second whose gradients are applied: a backup's dropped ones do not count."""
    return row["images_per_sec"] * (1 - (row.get("dropped_fraction") or 0.0))


def add_time(row: dict[str, Any], images: int, epochs: float) -> dict[str, Any]:
    """The row with seconds per epoch of `images` and hours to train `epochs` of them, at its
    predicted throughput (as the companion talk's model: epoch time = images / throughput)."""
    if images and not row.get("error"):
        row["epoch_images"], row["epoch_s"] = images, images / row["images_per_sec"]
        if epochs:
            row["epochs"], row["train_hours"] = epochs, epochs * row["epoch_s"] / 3600
    return row


def human_time(seconds: float) -> str:
    """A duration in the unit that reads at a glance ('2.8 ms', '9.9 s', '14 min', '3.2 h',
    '2.1 d'): one decimal below 10 of the unit (two below 1), whole ones above. Tables of hours
    to three digits ('0.00275 h') make the reader convert; JSON keeps seconds and hours."""
    if seconds < 0:
        return "-" + human_time(-seconds)
    if seconds == 0:
        return "0 s"
    for unit, size, below in (("ms", 1e-3, 1.0), ("s", 1.0, 90.0), ("min", 60.0, 5400.0), ("h", 3600.0, 172800.0)):
        if seconds < below:
            return _figure(seconds / size, unit)
    return _figure(seconds / 86400, "d")


def _figure(x: float, unit: str) -> str:
    return f"{x:.{2 if x < 1 else 1 if x < 10 else 0}f} {unit}"


def signed_time(seconds: float) -> str:
    """A difference of durations with its sign: '+14 min', '-9.9 s'."""
    return ("+" if seconds >= 0 else "") + human_time(seconds)


def rate(x: float) -> str:
    return f"{x:.1f}"


def whole(x: float) -> str:
    """A band's edge: as many digits as it has a meaning for (bands.py)."""
    return f"{x:.0f}" if x >= 100 else f"{x:.3g}"


def hours(h: float) -> str:
    return human_time(h * 3600)


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown: the predicted figures of each row, with its bottleneck (and epoch and training
    time, and the updates, images and hours to a target, where the rows have them). Throughput and
    the updates and time to a target show their band, 'value (low-high)', where the row has one
    (bands.py); the JSON has every figure's."""
    timed = any("epoch_s" in r for r in rows)
    trained = any("train_hours" in r for r in rows)
    targeted = any("target_hours" in r or "target_note" in r for r in rows)
    extra = (" Epoch |" if timed else "") + (" Training time |" if trained else "") + \
        (" Updates to target | Images to target | Time to target |" if targeted else "")
    columns = 10 + timed + trained + 3 * targeted
    lines = ["| Setup | Throughput (img/s) | Speedup | Efficiency | Step | Bottleneck | PS CPU | "
             "Busiest link | Staleness mean / p95 | Method |" + extra, "|---" * columns + "|"]
    for r in rows:
        if r.get("error"):
            lines.append(f"| {r['label']} | not predicted: {r['error']} |" + " |" * (columns - 2))
            continue
        stale = "-" if r["staleness_mean"] is None else f"{r['staleness_mean']:.2f} / {r['staleness_p95']:.0f}" + \
            (f", drops {r['dropped_fraction']:.0%}" if r["dropped_fraction"] else "")
        if "target_hours" in r:
            evals = f" ({human_time(r['target_eval_hours'] * 3600)} evaluating)" if r.get("target_eval_hours") else ""
            target = f" {shown(r, 'target_updates', lambda x: f'{x:.0f}')} | {r['target_images']:.3g} | " \
                     f"{shown(r, 'target_hours', hours)}{evals} |"
        else:
            target = f" {r.get('target_note', '-')} | | |"
        lines.append(f"| {scaling.setup(r)} | {shown(r, 'images_per_sec', rate, whole)} | {r['speedup']:.2f} | "
                     f"{r['efficiency']:.2f} | "
                     f"{human_time(r['step_s'])} | {r['bottleneck']} | {r['ps_cpu_util']:.2f} | "
                     f"{r['link_util']:.2f} | {stale} | {r['method']} |"
                     + (f" {human_time(r['epoch_s'])} |" if timed else "")
                     + (f" {human_time(r['train_hours'] * 3600)} |" if trained else "")
                     + (target if targeted else ""))
    return "\n".join(lines)
