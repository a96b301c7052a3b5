"""A cluster described, not measured: its nodes' GPUs, cores and links, its fabric and its file
system, turned into a profile for the recipe's own network.

A description is a TOML file with a `gpu` in its [node] table (profiles/nodes/ has K80, V100,
A100 and H100 nodes). `predict` and `predict --recommend` take one wherever they take a profile:

- compute: the network's training step counted on the meta device (layers.py) at the recipe's
  batch and twice it, priced on the GPU by the catalogue (gpus.py); a [measured] point (images/s
  at a batch, on one GPU of this node) replaces the catalogue's factor for this network;
- memory: the weights, gradients and optimizer slots of the network's parameters plus a fixed
  CONTEXT_BYTES, and the bytes autograd saves per image, against the GPU's memory;
- links: the node's GPU interconnect for averaging inside it, the host link for a PS pusher's
  copies, the fabric for everything between nodes, from their rates as given;
- input: what one loader core decodes (the project's input benchmark unless given), no more loaders
  than the node has cores for, and the shared file system's read rate over the mean file size.

The compute figure carries the catalogue's held-out error as its spread ([about].spread), the
band predictions show; a measured point carries none.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..config import Config, opt, read_toml
from ..errors import ModelError, ProfileError
from ..launch.flags import INPUT_BENCHMARK, LOADER_RATE, SOURCES
from . import gpus
from .layers import step_cost
from .profile import Profile, fits, load_profile, memory_text, read_sections

# CUDA context, cuDNN workspace and the caching allocator's slack on one GPU: about 0.5 GB of
# context for a current CUDA and a workspace of the same order; 1 GB, as the study's profile assumes.
CONTEXT_BYTES = 10**9
# Bytes of memory traffic an optimizer step makes per parameter (fp32): SGD with momentum reads
# the weight, gradient and momentum and writes the weight and momentum; TF's RMSProp has a mean
# square besides.
OPTIMIZER_BYTES = {"sgd": 20, "rmsprop-tf": 28}
# Optimizer slots (fp32 tensors the size of the weights) each optimizer keeps.
SLOTS = {"sgd": 1, "rmsprop-tf": 2}
# A parameter server's CPU work per gradient byte: one core ran SGD-momentum's update at 2.4 GB/s of
# gradient and the accumulation at 6.5 GB/s on this project's 2-core test host (torch, one thread,
# a ResNet-50-sized gradient); taken a little lower for messages' unpacking.
PS_APPLY_RATE, PS_ACCUMULATE_RATE = 2e9, 5e9
# The catalogue's held-out error (benchmarks/gpu_catalogue.py: ResNeXt-101 32x4d predicted from
# factors fitted on ResNet-50, its largest error), the compute figure's spread as +- this.
CATALOGUE_RESULT = "benchmarks/results/gpu-catalogue-2026-11-27T1559Z-06eea38.json"
CATALOGUE_ERROR = 0.1172


@dataclass(frozen=True)
class Cluster:
    gpu: str = opt("", "the GPU type, from the catalogue (scaletrain.perfmodel.gpus.CATALOGUE)")
    gpus: int = opt(1, "GPUs a node has, one replica each", lo=1, hi=64)
    cpu_cores: int = opt(0, "CPU cores a node has (0: not a limit on its loaders)", lo=0, hi=100_000)
    gpu_link_gbps: float = opt(100.0, "Gbit/s one GPU sends to the others of its node (NVLink, or PCIe)",
                               lo=0.001, hi=1e6)
    host_link_gbps: float = opt(100.0, "Gbit/s between a GPU and host memory (PCIe: gen3 x16 about 100, "
                                "gen4 200, gen5 400)", lo=0.001, hi=1e6)
    memory_copy_gbps: float = opt(80.0, "Gbit/s of a copy between two processes of a node (shared memory)",
                                  lo=0.001, hi=1e6)
    loader_rate: float = opt(0.0, "images/s one loader core decodes and augments (0: the project's input "
                             "benchmark's, for files or shards)", lo=0.0, hi=1e7)
    fabric: str = opt("", "the fabric between nodes, in words (e.g. InfiniBand HDR)")
    gbps: float = opt(10.0, "Gbit/s a node sends (and at once receives) over the fabric", lo=0.001, hi=1e6)
    latency_us: float = opt(5.0, "microseconds per message between nodes", lo=0.0, hi=1e6)
    read_gbps: float = opt(0.0, "Gbit/s the shared file system reads to all nodes together (0: not a limit)",
                           lo=0.0, hi=1e7)
    image_kb: float = opt(110.0, "kB of one training file on it (ImageNet's JPEGs average about 110)",
                          lo=0.001, hi=1e7)
    images_per_s: float = opt(0.0, "a training rate you measured on one GPU of this node with the recipe's "
                              "network and image size (0: the catalogue's)", lo=0.0, hi=1e8)
    batch: int = opt(0, "the batch per GPU that rate was measured at", lo=0, hi=100_000)


SECTIONS = {"node": ("gpu", "gpus", "cpu_cores", "gpu_link_gbps", "host_link_gbps", "memory_copy_gbps", "loader_rate"),
            "fabric": ("fabric", "gbps", "latency_us"),
            "storage": ("read_gbps", "image_kb"),
            "measured": ("images_per_s", "batch")}


def is_description(data: dict) -> bool:
    return isinstance(data.get("node"), dict) and "gpu" in data["node"]


def load_cluster(path: Path, data: dict | None = None) -> tuple[Cluster, dict]:
    """The description in `path` (its TOML already read: `data`) and its [about] table."""
    data = dict(read_toml(path, "cluster description", ProfileError) if data is None else data)
    about = data.pop("about", {})
    fabric = data.get("fabric", {})
    if isinstance(fabric, dict) and "type" in fabric:  # [fabric] type = "..." reads better than fabric.fabric
        data["fabric"] = {("fabric" if k == "type" else k): v for k, v in fabric.items()}
    c = Cluster(**read_sections(path, "cluster description", data, Cluster, SECTIONS))
    try:
        gpus.gpu(c.gpu)
    except ModelError as e:
        raise ProfileError(f"cluster description {path}: node.gpu: {e}") from None
    if bool(c.images_per_s) != bool(c.batch):
        raise ProfileError(f"cluster description {path}: [measured] needs both images_per_s and batch")
    return c, about


def profile_for(c: Cluster, about: dict, cfg: Config, path: Path) -> tuple[Profile, dict]:
    """The profile of one node of `c` training the recipe's network at its image size and batch,
    and its [about] table: the description's own, with what each figure rests on."""
    g, batch = gpus.gpu(c.gpu), cfg.data.batch_size
    mode = gpus.mode_for(g, cfg.train.precision)
    half = mode == "half"
    one, two = (step_cost(cfg.model, cfg.data.image_size, b, half) for b in (batch, 2 * batch))
    if c.images_per_s:
        measured = step_cost(cfg.model, cfg.data.image_size, c.batch, half)
        achieved, compute_source = gpus.fit(measured, g, mode, c.images_per_s), (
            f"[measured] {c.images_per_s:g} img/s at batch {c.batch} on one {g.name}")
    else:
        achieved, how = gpus.factor(g, mode)
        compute_source = (f"catalogue: {g.name} in {mode} mode, achieved-rate factor {achieved:.3f} ({how}; "
                          f"benchmarks/gpu_catalogue.py), {CATALOGUE_ERROR:.0%} held-out error ({CATALOGUE_RESULT})")
    t1, t2 = (gpus.step_s(s, g, mode, achieved) for s in (one, two))
    base_s = min(max(0.0, 2 * t1 - t2), 0.95 * t1)  # the line through (b, t1) and (2b, t2) at batch 0
    per_image = max(0, (two.saved_bytes - one.saved_bytes) // batch)
    optimizer = cfg.optim.name
    prof = Profile(
        model=cfg.model.name, model_args=dict(cfg.model.args), image_size=cfg.data.image_size,
        batch_per_replica=batch, gradient_bytes=4 * one.parameters,
        replicas_per_node=c.gpus, compute_s=t1, compute_base_s=base_s, device_memory=g.memory,
        memory_base=one.parameters * 4 * (2 + SLOTS.get(optimizer, 2)) + CONTEXT_BYTES
        + max(0, one.saved_bytes - batch * per_image),
        memory_per_image=per_image,
        optimizer_s=one.parameters * OPTIMIZER_BYTES.get(optimizer, 28) / (g.bandwidth * achieved),
        host_copy_bandwidth=c.host_link_gbps * 1e9 / 8, intra_bandwidth=c.gpu_link_gbps * 1e9 / 8,
        intra_latency=5e-6, net_bandwidth=c.gbps * 1e9 / 8, net_latency=c.latency_us * 1e-6,
        local_bandwidth=c.memory_copy_gbps * 1e9 / 8, ps_apply_rate=PS_APPLY_RATE,
        ps_accumulate_rate=PS_ACCUMULATE_RATE, ps_overlap=False,
        input_rate=input_rate(c, cfg), read_rate=c.read_gbps * 1e9 / 8 / (c.image_kb * 1e3))
    if not fits(prof, batch):
        raise ModelError(f"cluster description {path}: on the {g.name}, {memory_text(prof, batch)}")
    notes = {"compute": compute_source, "memory": f"{g.name}: {g.sheet}",
             "input": input_note(c, cfg), "ps": "PS_APPLY_RATE and PS_ACCUMULATE_RATE of perfmodel/cluster.py"}
    spread = {} if c.images_per_s else {"compute_s": round(2 * CATALOGUE_ERROR, 4)}
    return prof, {**about, "source": f"cluster description {path}", "derived": notes, "spread": spread}


def loaders_fit(c: Cluster, cfg: Config) -> float:
    """The share of data.workers loader processes per GPU the node's cores can run beside one
    training process per GPU (1: all of them)."""
    want = c.gpus * cfg.data.workers
    return 1.0 if not c.cpu_cores or not want else min(1.0, max(0, c.cpu_cores - c.gpus) / want)


def input_rate(c: Cluster, cfg: Config) -> float:
    """images/s of one loader as the model counts them: a core's decode rate, scaled down when the
    node has fewer cores than loaders; 0 (not modelled) for data that is not decoded from files."""
    source = SOURCES.get(cfg.data.name)
    if source is None or cfg.data.decode != "loader":
        return 0.0
    return (c.loader_rate or LOADER_RATE[source]) * loaders_fit(c, cfg)


def input_note(c: Cluster, cfg: Config) -> str:
    if not input_rate(c, cfg):
        return f"data.name = {cfg.data.name!r}, decode {cfg.data.decode!r}: input not modelled"
    rate = f"{c.loader_rate:g} img/s a core (given)" if c.loader_rate else f"the input benchmark ({INPUT_BENCHMARK})"
    share = loaders_fit(c, cfg)
    cores = "" if share == 1 else f"; {c.cpu_cores} cores run {share:.0%} of {c.gpus} x {cfg.data.workers} loaders"
    return rate + cores


def load_for(path: str | Path, cfg: Config) -> tuple[Profile, dict]:
    """The profile `path` gives for the recipe: a measured profile as it is (load_profile), a
    cluster description built for the recipe's network (profile_for)."""
    path = Path(path)
    data = read_toml(path, "profile", ProfileError)
    if not is_description(data):
        return load_profile(path)
    return profile_for(*load_cluster(path, data), cfg, path)
