"""`scaletrain calibrate`: measure a profile on this machine, with real processes.

- compute: a real single-replica training run of the recipe (one thread, no
  evaluation), its optimizer step measured apart and subtracted (and, where
  the training process loads its own batches, the input);
- input: where the recipe reads image files that are here, the images/s one
  loader core delivers from them (input_measure); else input_rate stays 0;
- optimizer: the recipe's optimizer stepping over a flat gradient of the
  model's size, one thread: the per-replica step and a PS's apply rate;
- accumulate: one gradient added into a sum, one thread: a synchronous PS's
  work per gradient;
- copy: one gradient copied from the replica's device into host memory (a
  memory copy on CPU): a pusher's packing of its messages and unpacking of
  the replies;
- point-to-point: two processes (torch.distributed, gloo) sending messages of
  4 bytes and of one gradient back and forth: latency and bandwidth;
- all-reduce: N processes all-reducing the same two sizes; the ring formula
  solved for latency and bandwidth;
- on a shared host, a real 2-replica all-reduce job: alone, the all-reduce
  microbenchmark runs with cores to spare, while in a job its bytes are
  copied by cores the job's other copies use. The job's step less compute
  and optimizer is its all-reduce under load; the all-reduce's bandwidth is
  divided by the factor (never below 1) that makes the ring that long. Its
  latency stays the microbenchmark's: waiting for the peer holds no core,
  and where replicas outnumber cores the others compute meanwhile;
- on a shared host, a real 2-node sync job with one PS: its transfers
  compete for the CPU and memory the job's other copies use, by an amount
  that depends on the gradient's size (whether it fits a cache). The
  bandwidths are divided by the factor (never below 1) that makes the
  model's step of that job the measured one; the latency stays.

A calibration that cannot be true (figures that moved between rounds, a job
orders of magnitude slower than its microbenchmark, a host others kept busy)
is flagged in the profile's [about] table (spread_flags, load_flags,
busy_flags), and `predict --recommend` refuses it without --force.

Each figure is the median of several rounds, each of which measures every
figure once (separate jobs and process pairs): loopback timings on a loaded
host move between runs, in spells that last minutes, and one run, or three
taken back to back, would decide the profile. The profile's [about] table
records each figure's spread.

Without a GPU every process of a local job shares this host's cores
(shared_cores = the core count) and nodes talk through loopback, so the
point-to-point figures stand for the network too. On a GPU machine, the
all-reduce runs on the GPUs (NCCL) and the network figures are still those
of this host's loopback: measure them between two nodes, or edit them. The
network's pair runs over the cluster twin's link (cluster.network = netns) or
between two Slurm nodes (calibrate in a 2-node job's batch step) instead: see
net_where.py; the loopback pair then gives the bandwidth inside a node alone.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import Any, get_type_hints

import torch

from ..config import Config
from ..errors import ProfileError
from ..metrics import pinned, sync
from ..optim import build_optimizer
from ..run import run_training
from ..job import pick_device
from .costs import ring_allreduce_s
from .input_rate import input_measure, input_text, input_unmeasured
from .net_where import BIG_MIN, LOOPBACK, SMALL, alpha_beta, measure_comm, net_figures, place, timed as _timed
from .predict import predict
from .profile import Profile, load_profile
from .rounds import rounds
from .setup import param_numels
from .trust import busy_flags, load_flags, machine_now, spread_flags

def ring_alpha_beta(n: int, t_small: float, t_big: float, nbytes: float) -> tuple[float, float]:
    """Solve t = 2(n-1)(alpha + nbytes / (n beta)) for the tiny and the big all-reduce."""
    alpha = t_small / (2 * (n - 1))
    return alpha, 2 * (n - 1) * nbytes / n / max(t_big - t_small, 1e-12)


def measure_optimizer(cfg: Config, numel: int) -> float:
    """Seconds of one optimizer step over `numel` parameters, one thread, on CPU."""
    torch.set_num_threads(1)
    w = torch.nn.Parameter(torch.zeros(numel))
    w.grad = torch.randn(numel) * 1e-3
    opt = build_optimizer(cfg.optim, [w])
    return _timed(opt.step, 10)


def measure_job(cfg: Config, replicas: int, warmup: int, steps: int, **shape) -> tuple[float, str]:
    """Seconds per step of a real local training job of the recipe (one node, `replicas`
    replicas of one thread each, all-reduce, no evaluation; `shape` overrides those keys),
    and its device. One batch an update (train.grad_accum_steps = 1): a profile's figures are of one
    batch of data.batch_size, which predict repeats per update (profile.accumulated)."""
    job = job_config(cfg, replicas, **shape).replace(**{
        "train.grad_accum_steps": 1, "train.threads": 1, "train.steps": warmup + steps,
        "train.warmup_log_steps": warmup, "train.eval_every": 0,
        "train.checkpoint_every": 0, "train.log_every": max(1, steps // 8)})
    with tempfile.TemporaryDirectory() as tmp:
        summary = run_training(job, Path(tmp) / "run", progress=False)
    if summary["images_per_sec"] is None:  # no log window after the warm-up: nothing to calibrate on
        raise ProfileError(f"calibrate: the {replicas}-replica job timed no log window in {steps} steps "
                           f"after {warmup} warm-up steps; raise --steps")
    return job.cluster.nodes * replicas * cfg.data.batch_size / summary["images_per_sec"], summary.get("device", "cpu")


def job_config(cfg: Config, replicas: int, nodes: int = 1, num_ps: int = 0, strategy: str = "allreduce") -> Config:
    return cfg.replace(**{"cluster.nodes": nodes, "cluster.gpus_per_node": replicas, "cluster.num_ps": num_ps,
                          "cluster.ps_placement": "alongside", "strategy.name": strategy, "strategy.slow_node": -1})


PS_JOB = {"nodes": 2, "num_ps": 1, "strategy": "sync"}  # the job that sets the transfers' load
MIN_LOAD = 0.2  # fit_transfer_load: transfers at most 5x as fast as the microbenchmark's


def fit_transfer_load(prof: Profile, cfg: Config, step_s: float) -> float:
    """The factor f by which a PS job's transfers move their bytes slower than the
    point-to-point microbenchmark: the model's step of PS_JOB with bandwidths / f equals the
    measured `step_s`. Loopback moves bytes with the CPU and memory the job's other copies are
    using; how much that costs depends on the sizes, which cache they fit. f may be below 1
    (down to MIN_LOAD): the job's transfers can be faster than the microbenchmark's, whose
    message has another size (at least BIG_MIN elements) and so fits the caches differently,
    and a factor held at 1 then predicts every PS row slow. Latency is waiting for the peer,
    which holds no core: it stays the microbenchmark's."""
    job = job_config(cfg, 1, **PS_JOB)

    def predicted(f: float) -> float:
        return predict(job, replace(prof, net_bandwidth=prof.net_bandwidth / f,
                                    local_bandwidth=prof.local_bandwidth / f))["step_s"]

    lo, hi = MIN_LOAD, 1e5
    if predicted(lo) >= step_s:
        return lo
    if predicted(hi) <= step_s:
        return hi
    for _ in range(30):  # bisection on a log scale: the step grows with f
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if predicted(mid) < step_s else (lo, mid)
    return (lo * hi) ** 0.5


def batch_line(b_ref: int, y_ref: float, b_other: int, y_other: float) -> tuple[float, float]:
    """The part of y (step seconds, device bytes) that does not grow with the batch, and the part
    per image, from y measured at two batches: the line through the two points, its intercept
    within [0, y_ref). Where y does not grow with the batch (noise), all of y_ref is taken as
    proportional: (0, y_ref / b_ref), the form that promises no gain from larger batches."""
    slope = (y_ref - y_other) / (b_ref - b_other)
    if slope <= 0:
        return 0.0, y_ref / b_ref
    base = min(max(0.0, y_ref - slope * b_ref), y_ref)
    return base, (y_ref - base) / b_ref


def measure_accumulate(numel: int) -> float:
    """Seconds of adding one gradient of `numel` floats into an accumulator (a synchronous
    shard's work per gradient), one thread."""
    torch.set_num_threads(1)
    acc, grad = torch.zeros(numel), torch.randn(numel)
    return _timed(lambda: acc.add_(grad), 10)


def copy_buffers(numel: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A gradient of `numel` floats on `device` and the host buffer it is copied into, as the PS
    path holds them: page-locked from a GPU (metrics.pinned; ps_client's buffers), else plain."""
    return torch.randn(numel).to(device), torch.empty(numel, pin_memory=pinned(device))


def measure_copy(numel: int, device: torch.device) -> float:
    """Seconds of copying a gradient of `numel` floats from `device` into host memory, one thread,
    as the job's push does: from a GPU into page-locked memory, queued, then waited for."""
    torch.set_num_threads(1)
    src, dst = copy_buffers(numel, device)

    def copy():
        dst.copy_(src, non_blocking=dst.is_pinned())
        sync(device)  # host-device sync: the copy is whole when the clock stops, as the push waits for it
    return _timed(copy, 10)


def calibrate(cfg: Config, warmup: int = 5, steps: int = 30, runs: int = 3, say=print,
              measure_input: bool = True) -> tuple[Profile, dict]:
    """Every figure is measured in `runs` rounds (jobs and process pairs started afresh each
    time, every figure once a round); the profile holds what derive() makes of their medians,
    and its [about] table the medians themselves ("measured") and each figure's spread. The input
    rate is one of them where the recipe's images are files here (input_measure) and
    `measure_input`; else it stays 0, and a line says why."""
    numel = sum(param_numels(cfg.model))
    where, cfg = place(cfg, numel)  # the network's pair: loopback, the twin, or two Slurm nodes (net_where.py)
    gpu = pick_device(cfg).type == "cuda"
    emulated = cfg.train.emulate_compute_s > 0
    cores = os.cpu_count() or 1
    n = max(2, min(4, torch.cuda.device_count() if gpu else cores))
    backend = "nccl" if gpu and n <= torch.cuda.device_count() else "gloo"
    big = max(numel, BIG_MIN)
    b_other = cfg.data.batch_size // 2 if cfg.data.batch_size > 1 else 2
    say(f"calibrate: {cfg.model.name}, {numel:,} parameters ({4 * numel / 1e6:.2f} MB of gradient), "
        f"each figure the median of {runs} rounds")
    device = "cpu"

    def job(c: Config, replicas: int, **shape) -> dict[str, float]:
        nonlocal device
        seconds, device = measure_job(c, replicas, warmup, steps, **shape)
        return {"step_s": seconds}

    measures: dict[str, Any] = {
        "cpu": lambda: {"optimizer_s": measure_optimizer(cfg, numel), "accumulate_s": measure_accumulate(numel),
                        "copy_s": measure_copy(numel, pick_device(cfg))},
        "job1": lambda: job(cfg, 1),
        # A second batch (half the recipe's, or 2 for a batch of 1) gives the part of compute that
        # does not grow with the batch; the optimizer step, in both, does not move the slope. An
        # emulated step sleeps the same whatever the batch.
        **({} if emulated else {"job1_other_batch": lambda: job(cfg.replace(**{"data.batch_size": b_other}), 1)}),
        "p2p": lambda: measure_comm(2, big),
        **({"net": where.run} if where else {}),
        **({} if n == 2 and backend == "gloo" else {"allreduce": lambda: measure_comm(n, big, backend)}),
        **({} if gpu else {"job2": lambda: job(cfg, 2), "ps_job": lambda: job(cfg, 1, **PS_JOB)}),
    }
    why = input_unmeasured(cfg) if measure_input else "not asked for (--no-input)"
    if why:
        how = "; calibrate a recipe whose data.root holds its images to model the loaders" if measure_input else ""
        say(f"  input: not measured, input_rate stays 0: {why}{how}")
    else:
        measures["input"] = input_measure(cfg)
    before = machine_now()
    m, spreads = rounds(measures, runs, say)
    after = machine_now()
    flags = spread_flags(spreads)
    host = {"device": device, "gpus": torch.cuda.device_count() if gpu else 0, "cores": cores,
            "allreduce_over": n, "big_elements": big, "other_batch": b_other, **(where.host() if where else {})}
    prof, about = derive(cfg, m, host, say)
    about.update(source=f"scaletrain calibrate on {os.uname().nodename}, {time.strftime('%Y-%m-%d %H:%M')}",
                 torch=torch.__version__, runs=runs, host=host,
                 measured={f"{name}.{k}": v for name, figs in m.items() for k, v in figs.items()}, spread=spreads,
                 input=f"not measured: {why}" if why else input_text(cfg))
    flags += load_flags(about) + busy_flags(before, after, cores)
    for flag in flags:
        say(f"  flag: {flag}")
    if flags:
        about["flags"] = flags
    return prof, about


def derive(cfg: Config, m: dict[str, dict[str, float]], host: dict, say=print) -> tuple[Profile, dict]:
    """The profile from calibrate's measurements `m` (name -> figure -> seconds) on `host`
    (calibrate's description of the machine; both are kept in a calibrated profile's [about],
    so that one can be derived again: rederive)."""
    nbytes = 4 * sum(param_numels(cfg.model))
    gpu, emulated, cores, device = host["gpus"] > 0, cfg.train.emulate_compute_s > 0, host["cores"], host["device"]
    n, big, b_other = host["allreduce_over"], host["big_elements"], host["other_batch"]
    cpu = m["cpu"]
    opt_s = cpu["optimizer_s"]
    say(f"  optimizer step: {opt_s * 1e3:.2f} ms ({nbytes / opt_s / 1e9:.2f} GB/s of gradient); "
        f"accumulate: {cpu['accumulate_s'] * 1e3:.2f} ms ({nbytes / cpu['accumulate_s'] / 1e9:.2f} GB/s); "
        f"copy to the host: {cpu['copy_s'] * 1e3:.2f} ms")
    rate = m.get("input", {}).get("images_per_s", 0.0)
    if rate:
        say(f"  input: {rate:.0f} img/s a loader core on {input_text(cfg)}")

    def own(batch: int) -> float:
        """Seconds a job's training process spent loading its batch: with data.workers = 0 it loads
        in series with compute, and that time is the input's (predict adds it back), not compute's."""
        return batch / rate if rate and not cfg.data.workers else 0.0
    step_s = m["job1"]["step_s"]
    compute_s = max(step_s - (0.0 if gpu else opt_s) - own(cfg.data.batch_size), 1e-6)
    say(f"  training step of one replica ({device}): {step_s * 1e3:.2f} ms")
    compute_base = 0.0
    if not emulated:
        other_s = m["job1_other_batch"]["step_s"]
        compute_base, _ = batch_line(cfg.data.batch_size, compute_s, b_other,
                                     max(other_s - (0.0 if gpu else opt_s) - own(b_other), 1e-6))
        say(f"  at batch {b_other}: {other_s * 1e3:.2f} ms; {compute_base * 1e3:.2f} ms of compute do not "
            f"grow with the batch")
    p2p = m["p2p"]
    lat, bw = alpha_beta(p2p[f"p2p_{SMALL}"], p2p[f"p2p_{big}"], 4 * big)
    say(f"  point-to-point (gloo, loopback): latency {lat * 1e6:.0f} us, {bw / 1e9:.2f} GB/s")
    ar = m.get("allreduce", p2p)
    ilat, ibw = ring_alpha_beta(n, ar[f"ar_{SMALL}"], ar[f"ar_{big}"], 4 * big)
    say(f"  all-reduce over {n} of {4 * big / 1e6:.0f} MB: {ar[f'ar_{big}'] * 1e3:.2f} ms; latency {ilat * 1e6:.0f} us, "
        f"{ibw / 1e9:.2f} GB/s")
    about: dict[str, Any] = {
        "device": device, "cores": cores,
        "note": f"network figures: {host.get('network', LOOPBACK)}" + ("" if not gpu or "network" in host
                                                                       else "; measure between nodes")
        + (f"; compute emulated: train.emulate_compute_s = {cfg.train.emulate_compute_s}" if emulated else "")}
    if not gpu:
        # The 2-replica job's all-reduce beyond the microbenchmark's is charged to its bytes: on one
        # host the cores copy them, and the job's other copies hold those cores; the latency is
        # waiting for the peer, which holds none (others compute meanwhile).
        job_s = m["job2"]["step_s"]
        ring = ring_allreduce_s(2, nbytes, ibw, ilat)
        load = max(1.0, (job_s - compute_s - own(cfg.data.batch_size) - opt_s - (ring - nbytes / ibw))
                   / (nbytes / ibw))
        say(f"  2-replica job: {job_s * 1e3:.2f} ms a step; the all-reduce's bytes {load:.2f} x as slow as "
            "in the microbenchmark")
        ibw = ibw / load
        about["allreduce_load"] = round(load, 4)
    prof = Profile(model=cfg.model.name, model_args=cfg.model.args, image_size=cfg.data.image_size,
                   batch_per_replica=cfg.data.batch_size,
                   gradient_bytes=nbytes, replicas_per_node=host["gpus"] or cores,
                   compute_s=compute_s, compute_base_s=min(compute_base, 0.999 * compute_s),
                   # Device memory is left unlimited (0) and unmeasured: on CPU the batch shares
                   # the host's RAM with everything else, no fixed device limit; on a GPU set
                   # device_memory, memory_base and memory_per_image by hand (nvidia-smi at two batches).
                   optimizer_s=0.0 if gpu else opt_s, host_copy_bandwidth=nbytes / cpu["copy_s"],
                   intra_bandwidth=ibw, intra_latency=ilat, net_bandwidth=bw, net_latency=lat,
                   local_bandwidth=bw, ps_apply_rate=nbytes / opt_s, ps_accumulate_rate=nbytes / cpu["accumulate_s"],
                   ps_overlap=False, input_rate=rate, shared_cores=0 if gpu else cores,
                   compute_on_cores=not (gpu or emulated))
    if not gpu:
        ps_s = m["ps_job"]["step_s"]
        f = fit_transfer_load(prof, cfg, ps_s)
        say(f"  2-node sync job with 1 PS: {ps_s * 1e3:.2f} ms a step; transfers' bytes {f:.2f} x as slow as "
            "in the microbenchmark")
        prof = replace(prof, net_bandwidth=bw / f, local_bandwidth=bw / f)
        about["transfer_load"] = round(f, 4)
    return net_figures(prof, about, m, host, say)


def rederive(path: Path, cfg: Config, say=print) -> tuple[Profile, dict]:
    """The profile a calibration in `path` gives with this version's derive(), from the
    measurements it kept."""
    _, about = load_profile(path)
    if "measured" not in about or "host" not in about:
        raise ProfileError(f"profile {path}: no [about.measured] and [about.host] tables: not written by "
                           "this version of scaletrain calibrate; calibrate again")
    m: dict[str, dict[str, float]] = {}
    for key, v in about["measured"].items():
        name, fig = key.split(".", 1)
        m.setdefault(name, {})[fig] = v
    prof, derived = derive(cfg, m, about["host"], say)
    return prof, {**about, **derived}


def median_profile(paths: list[Path]) -> tuple[Profile, dict]:
    """One profile from several calibrations of the same recipe: each numeric figure the median
    over them, its spread (max - min) / median in [about]. For calibrations taken at different
    times, each beside the measurements it is to predict (benchmarks/perfmodel.py)."""
    loaded = [load_profile(p) for p in paths]
    profs = [asdict(p) for p, _ in loaded]
    out, spreads, types = dict(profs[0]), {}, get_type_hints(Profile)
    for f in fields(Profile):
        values = [p[f.name] for p in profs]
        if types[f.name] is float:
            m = out[f.name] = statistics.median(values)
            spreads[f.name] = round((max(values) - min(values)) / m if m else 0.0, 4)
        elif any(v != values[0] for v in values):
            i = next(i for i, v in enumerate(values) if v != values[0])
            raise ProfileError(f"{paths[i]}: {f.name} = {values[i]!r}, not {values[0]!r} as in {paths[0]}: "
                               "calibrations of different setups")
    about = {**{k: v for k, v in loaded[0][1].items() if k != "measured"},  # each calibration keeps its own
             "source": f"median of {len(paths)} calibrations: " + ", ".join(map(str, paths)), "spread": spreads}
    flags = [f"{path}: {flag}" for path, (_, a) in zip(paths, loaded) for flag in a.get("flags", [])]
    about.pop("flags", None)
    if flags:  # a median holds off one odd calibration, not one that cannot be true: say which
        about["flags"] = flags
    loads = [a["transfer_load"] for _, a in loaded if "transfer_load" in a]
    if loads:
        about["transfer_load"] = statistics.median(loads)
    return Profile(**out), about
