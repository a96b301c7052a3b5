"""Hardware profiles: the figures the performance model runs on, as TOML.

A profile describes one kind of node and network for one workload (model,
image size, batch per replica). `scaletrain calibrate` measures one on this
machine; profiles/study-k80.toml is built from the study's published figures.
Other batches per replica follow a stated linear form (at_batch): compute time
and device memory each a part that does not depend on the batch plus one that
grows with it.
Every field has a one-line doc with its unit; loading checks names, types and
ranges and names the file and key of anything wrong.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import get_type_hints

import tomli_w

from ..config import check_value, opt, read_toml
from ..errors import ModelError, ProfileError


@dataclass(frozen=True)
class Profile:
    # workload the compute figures were measured for
    model: str = opt("resnet50", "network the compute figures belong to (a model.name)")
    model_args: dict = opt({}, "the model.args of that network, an import path's factory arguments ({} = none)")
    image_size: int = opt(224, "input side in pixels the compute figures belong to", lo=1, hi=100_000)
    batch_per_replica: int = opt(32, "images per replica per step the compute figures belong to", lo=1, hi=100_000)
    gradient_bytes: int = opt(0, "bytes of one full gradient (fp32 parameters x 4)", lo=1, hi=10**13)
    dataset_images: int = opt(0, "training images in one epoch, for epoch time (0 = not given; predict --images)",
                              lo=0, hi=10**12)
    epochs: float = opt(0.0, "epochs of a training run, for time to train (0 = not given; predict --epochs)",
                        lo=0.0, hi=1e6)
    # node
    replicas_per_node: int = opt(1, "replicas (GPUs, or CPU slots) one node offers", lo=1, hi=1024)
    compute_s: float = opt(1.0, "seconds of forward + backward of one replica's batch", lo=1e-7, hi=1e5)
    compute_base_s: float = opt(0.0, "seconds of compute_s that do not grow with the batch (kernel launches, "
                                "reading the weights); 0 = compute proportional to the batch", lo=0.0, hi=1e5)
    device_memory: int = opt(0, "bytes of memory of one replica's device (0 = no limit)", lo=0, hi=10**15)
    memory_base: int = opt(0, "bytes a replica's device holds whatever the batch (weights, gradients, "
                           "optimizer state, workspace)", lo=0, hi=10**15)
    memory_per_image: int = opt(0, "bytes of training activations one image of image_size adds on the device",
                                lo=0, hi=10**13)
    optimizer_s: float = opt(0.0, "seconds of one optimizer step on a replica's device (all-reduce)", lo=0.0, hi=1e5)
    host_copy_bandwidth: float = opt(0.0, "bytes/s of a PS pusher's copy of its gradient into its messages and of "
                                     "the new values back from the replies: device to host on a GPU, a memory "
                                     "copy on a CPU host (0: free)",
                                     lo=0.0, hi=1e15)
    intra_bandwidth: float = opt(1e10, "bytes/s between the replicas of a node (gradient averaging)", lo=1.0, hi=1e15)
    intra_latency: float = opt(1e-5, "seconds per message between the replicas of a node", lo=0.0, hi=10.0)
    # network
    net_bandwidth: float = opt(1e9, "bytes/s a node sends (and, at once, receives) to other nodes", lo=1.0, hi=1e15)
    net_latency: float = opt(1e-4, "seconds per message between nodes", lo=0.0, hi=10.0)
    local_bandwidth: float = opt(1e10, "bytes/s between two processes of one node (a PS alongside a worker)",
                                 lo=1.0, hi=1e15)
    # parameter server
    ps_apply_rate: float = opt(1e9, "gradient bytes/s a PS's optimizer update runs at: once per version when "
                               "synchronous, once per gradient when asynchronous (CPU work)", lo=1.0, hi=1e15)
    ps_accumulate_rate: float = opt(1e10, "gradient bytes/s a synchronous PS adds into its accumulator, once per "
                                    "gradient (CPU work)", lo=1.0, hi=1e15)
    ps_overlap: bool = opt(False, "false: gradients come in while a PS works, and it sends its replies itself, "
                           "in turn (scaletrain's server); true: replies move while it works too (a threaded "
                           "server, e.g. TensorFlow's)")
    # input pipeline: its own table, as it belongs to the data set's files and the node's CPU at once
    input_rate: float = opt(0.0, "images/s one loader core reads, decodes and augments to image_size "
                            "(0: input not modelled)", lo=0.0, hi=1e7)
    read_rate: float = opt(0.0, "images/s the file system the data set is on delivers to all of a job's nodes "
                           "together (a shared parallel file system's read bandwidth over the mean file size; "
                           "0: not a limit)", lo=0.0, hi=1e9)
    # host
    shared_cores: int = opt(0, "0: nodes are separate machines; C: every process of every node shares the "
                            "C CPU cores of one host (the local launcher)", lo=0, hi=100_000)
    compute_on_cores: bool = opt(True, "on a shared host: whether a replica's compute holds one of its cores (false: "
                                 "it runs elsewhere, a device, or is emulated by train.emulate_compute_s)")

    def describe(self) -> str:
        return (f"{self.model}, {self.image_size} px, batch {self.batch_per_replica} per replica; "
                f"{self.replicas_per_node} replicas per node at {self.compute_s * 1e3:.1f} ms per step")


def load_profile(path: str | Path) -> tuple[Profile, dict]:
    """The profile in `path` and its [about] table (provenance, assumptions)."""
    path = Path(path)
    data = read_toml(path, "profile", ProfileError)
    about = data.pop("about", {})
    values = read_sections(path, "profile", data, Profile, SECTIONS)
    missing = [k for k in ("model", "gradient_bytes", "compute_s") if k not in values]
    if missing:
        raise ProfileError(f"profile {path}: missing {', '.join(missing)}")
    prof = Profile(**values)
    if prof.compute_base_s >= prof.compute_s:
        raise ProfileError(f"profile {path}: node.compute_base_s = {prof.compute_base_s} must be below "
                           f"node.compute_s = {prof.compute_s} (the part of it that does not grow with the batch)")
    if not fits(prof, prof.batch_per_replica):
        raise ProfileError(f"profile {path}: {memory_text(prof, prof.batch_per_replica)}")
    return prof, about


def read_sections(path: Path, what: str, data: dict, cls: type, sections: dict[str, tuple[str, ...]]) -> dict:
    """The fields of dataclass `cls` that the TOML tables in `data` give, each checked (name, type,
    range) against its opt(); ProfileError naming the file and the key of anything wrong."""
    known, types = {f.name: f for f in fields(cls)}, get_type_hints(cls)
    values = {}
    for section, table in data.items():
        if section not in sections or not isinstance(table, dict):
            raise ProfileError(f"{what} {path}: unknown section [{section}]; sections are about, "
                               f"{', '.join(sections)}")
        for k, v in table.items():
            if k not in sections[section]:
                raise ProfileError(f"{what} {path}: unknown key {section}.{k}; [{section}] keys are "
                                   f"{', '.join(sections[section])}")
            try:
                values[k] = check_value(f"{section}.{k}", v, known[k], types[k])
            except ValueError as e:
                raise ProfileError(f"{what} {path}: {e}") from None
    return values


def compute_at(p: Profile, batch: int) -> float:
    """Seconds of forward + backward of `batch` images on one replica: the fixed part plus
    the rest of compute_s scaled by batch / batch_per_replica."""
    return p.compute_base_s + (p.compute_s - p.compute_base_s) * batch / p.batch_per_replica


def memory_at(p: Profile, batch: int, stages: int = 1, held: float | None = None) -> int:
    """Bytes one replica's device needs to train `batch` images a step; with pipeline stages, one
    stage's device: a 1/stages share of memory_base (weights, gradients, optimizer state, split
    evenly), and the activations of the fraction `held` of the batch, of a 1/stages share of the
    layers: the micro-batches it holds at once over their count (GPipe: all, 1F1B: at most `stages`
    of them, as the first stage holds)."""
    if stages == 1:
        return p.memory_base + batch * p.memory_per_image
    return int(p.memory_base / stages + (held if held is not None else 1.0) * batch * p.memory_per_image / stages)


def fits(p: Profile, batch: int, stages: int = 1, held: float | None = None) -> bool:
    return not p.device_memory or memory_at(p, batch, stages, held) <= p.device_memory


def largest_batch(p: Profile) -> int | None:
    """The largest batch per replica the device holds; None without a limit."""
    if not p.device_memory or not p.memory_per_image:
        return None
    return max(0, (p.device_memory - p.memory_base) // p.memory_per_image)


def memory_text(p: Profile, batch: int) -> str:
    """'batch 128 needs 13.80 GB (memory_base 1.00 GB + 128 x memory_per_image 0.100 GB) >
    device_memory 12.00 GB'."""
    return (f"batch {batch} per replica needs {memory_at(p, batch) / 1e9:.2f} GB (memory_base "
            f"{p.memory_base / 1e9:.2f} GB + {batch} x memory_per_image {p.memory_per_image / 1e9:.3f} GB) > "
            f"device_memory {p.device_memory / 1e9:.2f} GB")


def at_batch(p: Profile, batch: int, stages: int = 1, held: float | None = None) -> Profile:
    """The profile for `batch` images per replica: batch_per_replica = batch and compute_s at
    that batch (compute_at); the other figures do not depend on the batch, or scale with
    batch_per_replica themselves (input). Raises ModelError when the batch does not fit (with
    pipeline stages, one stage's share: memory_at)."""
    if batch < 1:
        raise ModelError(f"batch {batch} per replica: must be >= 1")
    if not fits(p, batch, stages, held):
        raise ModelError(memory_text(p, batch) if stages == 1 else
                         f"batch {batch} per replica in {stages} stages needs "
                         f"{memory_at(p, batch, stages, held) / 1e9:.2f} GB a stage > device_memory "
                         f"{p.device_memory / 1e9:.2f} GB")
    if batch == p.batch_per_replica:
        return p  # the measured point itself, not a rounding of it
    return replace(p, batch_per_replica=batch, compute_s=compute_at(p, batch))


def accumulated(p: Profile, k: int) -> Profile:
    """The profile of one update of k micro-batches of p's batch per replica (train.grad_accum_steps):
    k forwards and backwards of k x batch_per_replica images, while the gradient's communication and
    the optimizer's step stay once an update. The device memory stays a micro-batch's (at_batch)."""
    if k == 1:
        return p
    return replace(p, batch_per_replica=k * p.batch_per_replica, compute_s=k * p.compute_s,
                   compute_base_s=k * p.compute_base_s)


SECTIONS = {"workload": ("model", "model_args", "image_size", "batch_per_replica", "gradient_bytes", "dataset_images",
                         "epochs"),
            "node": ("replicas_per_node", "compute_s", "compute_base_s", "device_memory", "memory_base",
                     "memory_per_image", "optimizer_s", "host_copy_bandwidth", "intra_bandwidth", "intra_latency"),
            "network": ("net_bandwidth", "net_latency", "local_bandwidth"),
            "ps": ("ps_apply_rate", "ps_accumulate_rate", "ps_overlap"),
            "input": ("input_rate", "read_rate"),
            "host": ("shared_cores", "compute_on_cores")}


def dump_profile(profile: Profile, about: dict) -> str:
    flat = asdict(profile)
    return tomli_w.dumps({"about": about, **{s: {k: flat[k] for k in keys} for s, keys in SECTIONS.items()}})
