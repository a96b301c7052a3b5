"""What `scaletrain slurm` warns of in a job that would run, but not as meant, and the environment
the job's script must carry. Warnings, not refusals: the job may still be what its author wants.

- The run directory: every node of the job reads RUN_DIR/config.toml and writes its logs there,
  and the batch step reads what the login node wrote. A directory under /tmp, /var/tmp or /dev/shm,
  or on a file system local to a machine (ext4, xfs, tmpfs, overlay... by /proc/mounts), is each
  node's own: the job would start without its config.
- Loaders a GPU: a replica decoding its images on the host needs enough loader processes to keep
  its GPU busy. The figures come from the project's input benchmark (INPUT_BENCHMARK), not from
  a guess: what one loader core decodes, and how fast a replica of ResNet-50 at 224 px trains.
- PYTHONPATH: a network or dataset named by import path (model.name, data.name) imports on every
  node only if its directory is on the job's path; the directory it imports from here is written
  into the script, unless it is the interpreter's own (site-packages, the standard library).
"""

from __future__ import annotations

import importlib.util
import math
import os
import site
import sysconfig
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

from ..imports import is_import_path
from ..models.factory import build_network
from ..recipe_values import MODELS
from ..proc.cpus import NodeNeed, node_needs

# Under these a path is each machine's own whatever file system holds it.
NODE_LOCAL_DIRS = ("/tmp", "/var/tmp", "/dev/shm")
# File systems every node of a cluster mounts alike (/proc/mounts' type column); any other type is
# taken as the machine's own.
SHARED_FS = ("nfs", "nfs4", "lustre", "gpfs", "beegfs", "cephfs", "ceph", "fuse.ceph-fuse", "glusterfs",
             "fuse.glusterfs", "panfs", "pvfs2", "orangefs", "wekafs", "cifs", "smb3", "afs", "gfs2", "ocfs2",
             "fuse.juicefs")

# The input benchmark (`python benchmarks/input.py --save`; docs/data.md, "When data is the bottleneck").
# One loader core, 224 px, resized-crop + flip, medians of 5: img/s from JPEG files and from shards.
# A replica of ResNet-50 at 224 px on a current GPU trains at about GPU_RATE img/s, so it needs
# GPU_RATE / LOADER_RATE loader cores: 4.2 from files, 3.4 from shards (the file's cores_per_replica).
INPUT_BENCHMARK = "benchmarks/results/input-2026-11-26T0647Z-bb23a42.json"
LOADER_RATE = {"files": 595.0, "shards": 739.5}
GPU_RATE = 2500.0
# ResNet-50's forward FLOPs for one 224-px image, as torch.utils.flop_counter counts them (2 a
# multiply-add): a heavier network is taken to train slower in proportion, a lighter one at least as fast.
RESNET50_FLOPS = 8.18e9
SOURCES = {"imagefolder": "files", "manifest": "files", "shards": "shards"}


def node_local(path: Path, mounts: str | None = None) -> str:
    """Why `path` is each machine's own ('' when it is on a shared file system): under /tmp and
    the like, or on a local file system type. mounts: /proc/mounts' text (read when None)."""
    path = Path(os.path.abspath(path))
    for top in NODE_LOCAL_DIRS:
        if path == Path(top) or Path(top) in path.parents:
            return f"it is under {top}, which each node has its own of"
    if mounts is None:
        try:
            mounts = Path("/proc/mounts").read_text()
        except OSError:
            return ""  # no mount table (not Linux): nothing to say
    best, fstype = Path("/"), ""
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        point = Path(_unescape(fields[1]))
        if (point == path or point in path.parents) and len(point.parts) >= len(best.parts):
            best, fstype = point, fields[2]
    if not fstype or fstype in SHARED_FS:
        return ""
    return f"it is on a {fstype} file system ({best}), local to this machine"


def _unescape(field: str) -> str:
    """A /proc/mounts path: spaces, tabs, newlines and backslashes come as octal escapes (\\040)."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def run_dir_flag(run_dir: Path, mounts: str | None = None) -> list[str]:
    why = node_local(run_dir, mounts)
    if not why:
        return []
    return [f"run directory {run_dir}: {why}; the job's nodes read its config.toml and write their logs there, "
            f"so give --run-dir a directory on a shared file system (e.g. under your home or project directory)"]


def import_dirs(cfg) -> tuple[list[str], list[str]]:
    """(directories to put on the job's PYTHONPATH, warnings): where model.name's and data.name's
    modules import from here, when named by import path, and not the interpreter's own."""
    paths = sysconfig.get_paths()
    own = {os.path.realpath(paths[k]) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    own |= {os.path.realpath(site.getusersitepackages())}
    dirs, flags = [], []
    for key, name in (("model.name", cfg.model.name), ("data.name", cfg.data.name)):
        if not is_import_path(name) or name.partition(":")[0] in ("torchvision", "timm"):
            continue
        top = name.partition(":")[0].split(".")[0]
        try:
            spec = importlib.util.find_spec(top)  # the top package only: nothing of it runs
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            flags.append(f"{key} = {name!r}: module {top} is not found here; it must import on every node "
                         "(installed in the job's environment, or its directory on PYTHONPATH)")
            continue
        # A package (regular or namespace) lists its own directory; a module file is its origin.
        locations = list(spec.submodule_search_locations or [])
        found = Path(locations[0] if locations else spec.origin).parent
        found_real = os.path.realpath(found)
        if any(found_real == d or found_real.startswith(d + os.sep) for d in own):
            continue
        if str(found) not in dirs:
            dirs.append(str(found))
            why = node_local(found)
            if why:
                flags.append(f"{key} = {name!r} imports from {found}: {why}; put it on a shared file system so "
                             "that every node can import it")
    return dirs, flags


def network_flops(cfg) -> float | None:
    """Forward FLOPs of one image of data.image_size through the recipe's network, counted on the
    meta device (no memory, no compute); None when it cannot be built there."""
    side = cfg.data.image_size
    try:
        with torch.device("meta"):
            model = build_network(cfg.model)
        with FlopCounterMode(display=False) as counter:
            model(torch.empty(1, 3, side, side, device="meta"))
    except Exception:  # noqa: BLE001 - a user's network that will not build on meta: no figure, no flag
        return None
    return float(counter.get_total_flops())


def loaders_needed(cfg, flops: float | None) -> tuple[int, float, float] | None:
    """(loader processes a GPU, the GPU's img/s, a loader core's img/s) that keep a current GPU
    busy with the recipe's network and data, or None where the benchmark does not speak: data
    not decoded from JPEG files or shards on the host, or a network whose FLOPs are unknown."""
    source = SOURCES.get(cfg.data.name)
    if source is None or cfg.data.decode != "loader" or flops is None:
        return None
    rate = GPU_RATE * min(1.0, RESNET50_FLOPS / flops) if flops > 0 else GPU_RATE
    return math.ceil(rate / LOADER_RATE[source] - 1e-9), rate, LOADER_RATE[source]


def loader_flag(cfg, gpus: int, need: NodeNeed | None, flops: float | None) -> list[str]:
    """A warning when data.workers is below what the recipe's network needs on a GPU."""
    if not gpus:
        return []
    got = loaders_needed(cfg, flops)
    if got is None or cfg.data.workers >= got[0]:
        return []
    want, rate, core = got
    net = cfg.model.name if cfg.model.name in MODELS else f"model.name = {cfg.model.name!r}"
    ratio = flops / RESNET50_FLOPS if flops else 1.0
    if ratio > 1.05:
        speed = f"{ratio:.1f} times ResNet-50's FLOPs at 224 px, trains at about {rate:,.0f} img/s a GPU"
    elif ratio < 0.95:
        speed = f"lighter than ResNet-50 at 224 px, trains at {rate:,.0f} img/s a GPU or more"
    else:
        speed = f"trains at about {rate:,.0f} img/s a GPU"
    cpus = ""
    if need is not None and need.workers:
        more = NodeNeed(need.node, need.workers, want, need.worker_threads, need.ps, need.ps_threads)
        cpus = f" (its busiest node then needs {more.cpus} CPUs)"
    return [f"data.workers = {cfg.data.workers} loader processes a GPU, below the {want} a current GPU needs: {net} at "
            f"{cfg.data.image_size} px, {speed}, and one loader core decodes {core:,.0f} img/s from "
            f"{SOURCES[cfg.data.name]}: {rate / core:.1f} cores' worth ({INPUT_BENCHMARK}); raise data.workers to "
            f"{want}{cpus} or set data.decode = device"]


def job_flags(cfg, plan, run_dir: Path, gpus: int, mounts: str | None = None) -> tuple[list[str], list[str]]:
    """(PYTHONPATH directories for the script, warnings) of a job about to be written."""
    dirs, flags = import_dirs(cfg)
    flags = run_dir_flag(run_dir, mounts) + flags
    if gpus and loaders_needed(cfg, RESNET50_FLOPS) is not None:  # worth counting the network's FLOPs
        busiest = max((n for n in node_needs(plan, cfg) if n.workers), key=lambda n: n.cpus, default=None)
        flags += loader_flag(cfg, gpus, busiest, network_flops(cfg))
    return dirs, flags
