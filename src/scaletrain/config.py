"""Typed, frozen, documented configuration.

A recipe is a TOML file with one table per section ([model], [data], ...).
`--set section.key=value` overrides a key; the value is read as TOML (so
`train.steps=200`, `data.augment=["crop", "flip"]` and bare `data.augment=crop+flip` all work).
Every field carries a one-line doc with its unit and range in its metadata;
`load_config` checks names, types, ranges and choices before any work starts,
raising ConfigError with one line that names the key, the value and what is
allowed.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, get_type_hints

import tomli_w

from .config_checks import ROOTS, check_relations  # noqa: F401 - ROOTS: doctor's and preflight's, as config's
from .errors import ConfigError
from .imports import name_or_path
from .loggers import parse_loggers
from .recipe_values import DATA_SOURCES, parse_augment, parse_data_name, parse_lines, parse_model_name
from .strategies.traits import REGISTRY


def opt(default, doc: str, *, choices=None, lo=None, hi=None, parse=None):
    """A config field: default, one-line doc (unit, range), optional checks; `parse` turns what a
    recipe may write into the stored value, raising ValueError with what is allowed."""
    meta = {"doc": doc, "choices": choices, "lo": lo, "hi": hi, "parse": parse}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class ModelConfig:
    name: str = opt("resnet20", "network: resnet8 | resnet20 (CIFAR-style) | resnet18 | resnet50, or your own by "
                    "import path: package.module:factory (called with num_classes= and model.args; the module "
                    "importable on every node) | torchvision:NAME | timm:NAME (installed beside the torch there: "
                    "docs/devices.md)", parse=parse_model_name)
    num_classes: int = opt(1200, "number of output classes (1..100000)", lo=1, hi=100_000)
    norm: str = opt("batch", "built-in ResNets: normalisation layer: batch (BatchNorm) | group (GroupNorm, "
                    "batch-independent)", choices=("batch", "group"))
    width: int = opt(16, "built-in CIFAR-style ResNets: channels of the first stage (4..256)", lo=4, hi=256)
    init_from: str = opt("", "pretrained weights: path to .safetensors or a torch state dict ('' = random init)")
    args: dict = opt({}, "an import-path model.name's factory: its keyword arguments besides num_classes, a "
                     "table: [model.args] in a recipe, --set model.args.KEY=VALUE ({} = none)")


@dataclass(frozen=True)
class DataConfig:
    name: str = opt("digits", f"dataset: {' | '.join(DATA_SOURCES)} | package.module:factory "
                    "(a function of yours returning a torch Dataset or (train, test, classes); docs/data.md)",
                    parse=parse_data_name)
    args: dict = opt({}, "data.name = package.module:factory: the factory's keyword arguments, a table "
                     "[data.args] ({} = none)")
    root: str = opt("", "imagefolder: directory root/CLASS/*.jpg|png; manifest: CSV file of path,label; "
                    "shards: directory written by scaletrain pack")
    test_root: str = opt("", "optional held-out set in the same form as root ('' = split off test_fraction)")
    test_fraction: float = opt(0.1, "fraction of root (or of a factory's Dataset) held out for testing when "
                               "test_root is empty (0..0.9)", lo=0.0, hi=0.9)
    image_size: int = opt(32, "side of the square network input, pixels (8..1024)", lo=8, hi=1024)
    batch_size: int = opt(32, "images per replica per step (1..4096)", lo=1, hi=4096)
    augment: list = opt([], "training augmentations, a list of resized-crop | crop | flip | rotation | lens | "
                        "vignetting | color (false or [] = none)", parse=parse_augment)
    shuffle_buffer: int = opt(4096, "shards: each replica reads its stretch of an epoch in order and shuffles "
                              "within a window of this many samples (1..10^7)", lo=1, hi=10**7)
    on_bad_image: str = opt("error", "unreadable image: error (stop, naming the file) | skip (count, report)",
                            choices=("error", "skip"))
    workers: int = opt(2, "background loader processes per replica (0 = load in the training process)",
                       lo=0, hi=64)
    prefetch: int = opt(2, "batches each loader process prepares ahead (1..16)", lo=1, hi=16)
    decode: str = opt("loader", "where JPEGs are decoded, cropped and flipped: loader (its processes, on the host) | "
                      "device (the loader processes read bytes; the training process decodes each batch on its "
                      "device: nvJPEG through torchvision on a GPU, libjpeg-turbo on a CPU device; docs/data.md)",
                      choices=("loader", "device"))
    synthetic_size: int = opt(4096, "synthetic: images per epoch (1..10^8)", lo=1, hi=100_000_000)
    mixup_alpha: float = opt(0.0, "mixup: each training image blended with a partner of its batch, weight drawn "
                             "from Beta(alpha, alpha), targets mixed alike (0 = off; 0..100; docs/training.md)",
                             lo=0.0, hi=100.0)
    cutmix_alpha: float = opt(0.0, "CutMix: a box of each training image replaced by its partner's, area share "
                              "from Beta(alpha, alpha); with mixup_alpha too, each batch takes one of the two "
                              "with probability 0.5 (0 = off; 0..100)", lo=0.0, hi=100.0)


# optim.name's built-in optimizers (optim.py); any other name is a class by import path.
OPTIMIZERS = ("sgd", "rmsprop-tf", "adamw", "lars", "lamb")


@dataclass(frozen=True)
class OptimConfig:
    name: str = opt("sgd", "optimizer: rmsprop-tf (TensorFlow 1.x RMSProp) | sgd (with momentum) | adamw | lars | "
                    "lamb (decoupled weight decay, none on biases and normalisation; lars and lamb adapt each layer's "
                    "step by its trust ratio) | package.module:Class, a torch.optim.Optimizer of your own, called "
                    "as Class(params, lr=optim.lr, **optim.args) (under a PS, over each shard's flat slice)",
                    parse=name_or_path(OPTIMIZERS, "a built-in optimizer"))
    lr: float = opt(0.1, "peak learning rate (0..10)", lo=0.0, hi=10.0)
    momentum: float = opt(0.9, "sgd, lars, rmsprop-tf: momentum (0..<1); rmsprop-tf applies it to the scaled "
                               "update as TF does", lo=0.0, hi=0.999999)
    decay: float = opt(0.9, "rmsprop-tf: decay of the mean-square accumulator (0..<1)", lo=0.0, hi=0.999999)
    eps: float = opt(1.0, "rmsprop-tf: epsilon, inside the square root as in TF 1.x (>0)", lo=1e-12, hi=1e3)
    weight_decay: float = opt(1e-4, "sgd, rmsprop-tf and a class of yours: an L2 term added to the loss, wd/2 * sum "
                              "of squared conv and linear weights; adamw, lars, lamb: decoupled, applied by the "
                              "optimizer (not biases or normalisation), and no L2 term in the loss (0..1)",
                              lo=0.0, hi=1.0)
    beta1: float = opt(0.9, "adamw, lamb: decay of the gradient's running mean (0..<1)", lo=0.0, hi=0.999999)
    beta2: float = opt(0.999, "adamw, lamb: decay of the squared gradient's running mean (0..<1)", lo=0.0,
                       hi=0.999999)
    adaptive_eps: float = opt(1e-8, "adamw, lamb: epsilon added to the root of the second moment; lars: to the "
                              "trust ratio's denominator (>0)", lo=1e-12, hi=1.0)
    trust_coefficient: float = opt(0.001, "lars: the trust coefficient eta of a layer's ratio eta*|w|/(|g| + "
                                   "wd*|w|) (>0..1)", lo=1e-9, hi=1.0)
    args: dict = opt({}, "optim.name = package.module:Class: its keyword arguments besides params and lr, a table "
                     "[optim.args] ({} = none)")
    schedule: str = opt("constant", "learning-rate schedule after warm-up: constant | step | cosine",
                        choices=("constant", "step", "cosine"))
    warmup_steps: int = opt(0, "linear warm-up from 0 to lr, steps (>=0)", lo=0, hi=10**9)
    step_size: int = opt(1000, "step schedule: multiply lr by gamma every this many steps (>=1)", lo=1, hi=10**9)
    gamma: float = opt(0.1, "step schedule: factor applied every step_size steps (0..1)", lo=0.0, hi=1.0)
    scale_lr: str = opt("none", "scale lr with the images per update: none | linear (x B/reference_batch) | "
                        "sqrt (x sqrt(B/reference_batch)) | noise (x (1 + N/reference_batch) / (1 + N/B), N = "
                        "optim.noise_scale: the rule under which predict --until holds); warm-up then rises from "
                        "lr to the scaled lr", choices=("none", "linear", "sqrt", "noise"))
    reference_batch: int = opt(256, "images per update that optim.lr was set for, for scale_lr (1..10^7)",
                               lo=1, hi=10**7)
    noise_scale: float = opt(0.0, "the gradient noise scale for scale_lr = noise, in images: a measured run's "
                             "summary.json noise_scale (>0 with that rule)", lo=0.0, hi=1e9)

    def __post_init__(self) -> None:
        if self.args and self.name in OPTIMIZERS:
            raise ConfigError(f"optim.args = {self.args!r}: the keyword arguments of a class of yours (optim.name = "
                              f"package.module:Class); optim.name = {self.name!r} takes none")
        unread = [k for k, names in READ_BY.items() if self.name not in names
                  and getattr(self, k) != OptimConfig.__dataclass_fields__[k].default]
        if unread:
            raise ConfigError(f"optim.{unread[0]} = {getattr(self, unread[0])!r}: optim.name = {self.name!r} does not "
                              f"read it (read by {' and '.join(READ_BY[unread[0]])} only)")


# The optimizer-specific keys, and the optimizers that read them: set for another, one would do nothing.
READ_BY = {"momentum": ("sgd", "rmsprop-tf", "lars"), "decay": ("rmsprop-tf",), "eps": ("rmsprop-tf",),
           "beta1": ("adamw", "lamb"), "beta2": ("adamw", "lamb"), "adaptive_eps": ("adamw", "lars", "lamb"),
           "trust_coefficient": ("lars",)}


@dataclass(frozen=True)
class TrainConfig:
    steps: int = opt(0, "job steps (updates) to run: the run ends when steps x replicas x data.batch_size x "
                     "train.grad_accum_steps images have been applied, whatever the strategy (0 = derive from "
                     "epochs)", lo=0, hi=10**9)
    grad_accum_steps: int = opt(1, "micro-batches of data.batch_size images a replica computes per update: their "
                                "gradients accumulate, their mean is what the strategy averages and applies, once "
                                "per this many (1 = every batch; 1..4096)", lo=1, hi=4096)
    epochs: float = opt(1.0, "passes over the training set, used when steps = 0 (>0)", lo=0.0, hi=1e6)
    seed: int = opt(0, "seed of initialisation, data order and augmentation (>=0)", lo=0, hi=2**31 - 1)
    deterministic: bool = opt(False, "bit-reproducible kernels and data (slower on GPU)")
    eval_every: int = opt(0, "evaluate on the test set every this many job steps (0 = only at the end)",
                          lo=0, hi=10**9)
    target_accuracy: float = opt(0.0, "stop at the first evaluation whose test accuracy reaches this (0 = off; "
                                 "0..1)", lo=0.0, hi=1.0)
    target_loss: float = opt(0.0, "stop at the first evaluation where the mean train loss of all replicas "
                             "since the previous one is at most this (0 = off; >=0)", lo=0.0, hi=1e6)
    checkpoint_every: int = opt(0, "save a checkpoint every this many job steps (0 = only at the end)",
                                lo=0, hi=10**9)
    checkpoint_every_s: float = opt(0.0, "also checkpoint at the first sync point after this many seconds of the job "
                                    "since the last checkpoint (0 = off), seconds", lo=0.0, hi=1e7)
    keep_checkpoints: int = opt(2, "complete checkpoints kept on disk (1..100)", lo=1, hi=100)
    log_every: int = opt(10, "write a metrics row every this many job steps (1..10^6)", lo=1, hi=10**6)
    loggers: list = opt(["tensorboard"], "where the chief's metrics rows go besides RUN_DIR/metrics.jsonl, which "
                        "is always written (report, plots and restarts read it): a list of tensorboard | a class "
                        "of yours as package.module:Class ([] = metrics.jsonl only)", parse=parse_loggers)
    noise_every: int = opt(0, "a replica with no group to average with (one process, or one per node under a PS) "
                           "measures the gradient noise scale every this many steps, by one more backward of the "
                           "first half of its batch through job.loss (0 = never; a group measures it every step "
                           "at no cost)", lo=0, hi=10**6)
    label_smoothing: float = opt(0.0, "training targets: 1 - this on the class, plus this spread evenly over "
                                 "every class, as soft targets (0 = off; 0..<1)", lo=0.0, hi=0.999999)
    ema_decay: float = opt(0.0, "keep an exponential moving average of the weights, decay d a step "
                           "(e.g. 0.999; warmed up as min(d, (1 + n) / (10 + n))), evaluated beside them as "
                           "test_accuracy_ema and saved in checkpoints and model-ema.safetensors; "
                           "train.target_accuracy stays on the weights (0 = off; 0..<1)", lo=0.0, hi=0.999999)
    warmup_log_steps: int = opt(2, "first job steps left out of throughput figures (compile, caches)", lo=0, hi=10**6)
    device: str = opt("auto", "auto (CUDA when present) | cpu | cuda", choices=("auto", "cpu", "cuda"))
    precision: str = opt("fp32", "fp32 | bf16 (autocast on CUDA only)", choices=("fp32", "bf16"))
    channels_last: bool = opt(False, "use the channels_last memory format on CUDA")
    compile: bool = opt(False, "compile forward and backward with torch.compile (a one-off cost of seconds to "
                        "minutes at the first steps, which bench's warm-up steps should cover)")
    threads: int = opt(0, "CPU threads for torch in this process (0 = torch's default)", lo=0, hi=1024)
    emulate_compute_s: float = opt(0.0, "emulated GPU: each replica's forward and backward become a sleep of this "
                                   "many seconds and a fixed gradient (from seed); no data is read, a step counts "
                                   "data.batch_size images a replica, the loss is NaN, nothing is evaluated (0 = real "
                                   "compute; 0..60), seconds", lo=0.0, hi=60.0)


@dataclass(frozen=True)
class ClusterConfig:
    nodes: int = opt(1, "worker nodes (1..4096)", lo=1, hi=4096)
    gpus_per_node: int = opt(1, "processes per worker node, one GPU each: its replicas, times parallel.stages when a "
                             "replica is split (1..16)", lo=1, hi=16)
    num_ps: int = opt(0, "parameter-server processes, each holding one shard (0..4096)", lo=0, hi=4096)
    ps_placement: str = opt("alongside", "alongside (on worker nodes, at most one per node, no GPU) | "
                            "dedicated (one extra node per PS)", choices=("alongside", "dedicated"))
    sharding: str = opt("balanced", "split of parameters over PS: balanced (equal contiguous ranges) | "
                        "round-robin (whole tensors, as the study did)", choices=("balanced", "round-robin"))
    timeout_s: float = opt(60.0, "liveness: a process silent (dead or frozen) this long is lost and the job "
                           "stops; also the rendezvous wait; healthy work may take any time, seconds (1..86400)",
                           lo=1.0, hi=86400.0)
    max_restarts: int = opt(0, "restart a failed job from its newest complete checkpoint up to this many times "
                            "(local launcher and Slurm job step; 0..1000)", lo=0, hi=1000)
    survive_loss: bool = opt(False, "a lost worker node (killed, frozen, cut off) is dropped within timeout_s and the "
                             "job goes on without it, no restart: under allreduce, async-allreduce, local-sgd and "
                             "diloco the replicas' "
                             "group re-forms among the survivors (under allreduce the learning rate follows the "
                             "smaller batch by optim.scale_lr), "
                             "under sync the shards wait for the nodes left; the asynchronous modes and backup always "
                             "do; never without the chief's node; a lost PS shard is taken on by a live one, from "
                             "the newest values a worker holds (docs/fault-tolerance.md)")
    after_loss: str = opt("scale-lr", "with survive_loss under allreduce, an update of fewer replicas: scale-lr (the "
                          "learning rate follows the smaller batch by optim.scale_lr) | keep-batch (each replica "
                          "left accumulates ceil(k N / n) micro-batches, so the global batch stays the recipe's "
                          "where n divides k N; the rate follows it where it cannot)",
                          choices=("scale-lr", "keep-batch"))
    replacements: int = opt(0, "with survive_loss under allreduce, local-sgd or diloco, the launcher (local, or each "
                            "rank's keeper under torchrun and Slurm) starts a replacement for a dropped worker, which "
                            "joins at a step boundary with a live replica's weights, optimizer and data position (no "
                            "checkpoint read), up to this many over the job (0..1000)",
                            lo=0, hi=1000)
    min_nodes: int = opt(0, "a restart may leave a failed worker node out while this many remain "
                         "(strategy allreduce; 0 = always cluster.nodes; 0..4096)", lo=0, hi=4096)
    stop_signals: str = opt("SIGTERM,SIGUSR1", "signals that stop the job after a checkpoint at the next step all "
                            "processes agree on (comma-separated; Ctrl-C/SIGINT always does)")
    master_addr: str = opt("127.0.0.1", "host name or IP address of rank 0 for the rendezvous")
    master_port: int = opt(0, "TCP port of the rendezvous on master_addr (0 = pick a free port, 0..65535)",
                           lo=0, hi=65535)
    backend: str = opt("auto", "communication between GPU replicas: auto (NCCL; gloo on CPUs) | gloo (slower, "
                       "but replicas of one host may share a GPU)", choices=("auto", "gloo"))
    ifname: str = opt("", "network interface for gloo's and NCCL's sockets, e.g. ib0 ('' = an InfiniBand ib* "
                      "interface where there is one, loopback for a job on this machine, else the host name's)")
    network: str = opt("loopback", "how the local launcher's emulated nodes reach each other: loopback (at memory "
                       "speed) | netns (the cluster twin: a network namespace per node, links shaped to link_gbps; "
                       "root; docs/twin.md)", choices=("loopback", "netns"))
    link_gbps: float = opt(10.0, "the cluster twin: each node's link, Gbit/s each way (0.001..400)", lo=0.001, hi=400.0)
    slow_link_node: int = opt(-1, "the cluster twin: node whose link runs at slow_link_gbps (-1 = none)", lo=-1, hi=4095)
    slow_link_gbps: float = opt(1.0, "the cluster twin: the slow node's link, Gbit/s each way (0.001..400)",
                                lo=0.001, hi=400.0)
    time_scale: float = opt(1.0, "the cluster twin's time dilation k: emulated compute k times longer and links k "
                            "times slower, figures reported at the cluster's speed (1..1000)", lo=1.0, hi=1000.0)
    ps_threads: int = opt(0, "CPU threads a PS process takes at least; under Slurm it also takes every CPU of its "
                          "node the workers there leave (0 = 1, or the local launcher's share; 0..1024)", lo=0, hi=1024)
    setup: list = opt([], "shell lines a Slurm job runs before it starts, e.g. [\"module load cuda/12.4\"]; "
                      "srun passes the environment they make on to every process ([] = none)", parse=parse_lines)

    @property
    def stopping(self) -> tuple[str, ...]:
        """The names of the signals that stop the job after a checkpoint: stop_signals and SIGINT."""
        return tuple(dict.fromkeys([n.strip() for n in self.stop_signals.split(",") if n.strip()] + ["SIGINT"]))


@dataclass(frozen=True)
class StrategyConfig:
    name: str = opt("allreduce", f"how replicas synchronise: {' | '.join(REGISTRY)}", choices=tuple(REGISTRY))
    backup_workers: int = opt(0, "backup: node gradients a version may go without, b (0..nodes-1)", lo=0, hi=4095)
    async_bound: int = opt(0, "async-allreduce: gradients a replica computes while a round is in flight before "
                           "it waits for the round (0 = never waits; 1 = every update exactly 1 stale; 0..4096)",
                           lo=0, hi=4096)
    sync_every: int = opt(8, "local-sgd and diloco: replicas step alone and meet at the job steps that are "
                          "multiples of this, where they average their weights (local-sgd) or apply their averaged "
                          "change (diloco); evaluations and checkpoints wait for a meeting, a stop does not (1..64, "
                          "the staleness histogram's bins)", lo=1, hi=64)
    outer_lr: float = opt(0.5, "diloco: the outer optimizer's learning rate, applied to the replicas' averaged "
                          "change since the last meeting (1 with outer_momentum 0 is local-sgd; Douillard et al. "
                          "2023 use 0.7 with momentum 0.9 at 500 steps between meetings, which on digits at 4-32 "
                          "overshoots: docs/strategies.md; 0.001..10)", lo=0.001, hi=10.0)
    outer_momentum: float = opt(0.8, "diloco: the outer optimizer's Nesterov momentum (0..0.999)", lo=0.0, hi=0.999)
    slow_node: int = opt(-1, "stragglers: node whose replicas compute slower (-1 = none)", lo=-1, hi=4095)
    slow_delay_s: float = opt(0.0, "stragglers: seconds added to each update's compute on slow_node (0..60)",
                               lo=0.0, hi=60.0)
    emulate_workers: int = opt(0, "one process trains as K equal-speed asynchronous workers would: each "
                               "gradient K-1 updates stale; with strategy.name = async-allreduce, as K replicas "
                               "whose rounds take a step: each update the mean of K gradients one update stale "
                               "(0 = off; 1..64)", lo=0, hi=64)
    staleness_lr: str = opt("none", "asynchronous updates (async and mixed-async shards, the emulator): none | "
                            "inverse (a gradient's learning rate divided by its staleness + 1, Zhang et al. 2016)",
                            choices=("none", "inverse"))
    delay_compensation: float = opt(0.0, "asynchronous updates: DC-ASGD's lambda (Zheng et al. 2017), each gradient "
                                    "g computed on values w_then corrected to g + lambda * g * g * (w_now - w_then) "
                                    "(0 = off; 0..10^6: products of batch-mean gradients are small, so useful "
                                    "values are large)", lo=0.0, hi=1e6)
    compression: str = opt("none", "gradients and values on the wire between nodes: none | fp16 | bf16 (half the "
                           "bytes; an all-reduce sums in that type, a PS shard adds and applies in fp32)",
                           choices=("none", "fp16", "bf16"))


@dataclass(frozen=True)
class ParallelConfig:
    stages: int = opt(1, "pipeline stages a replica's network is split into, one process (GPU) each, side by side on "
                      "a node: cluster.gpus_per_node = stages x replicas per node (1 = no split; 1..16)", lo=1, hi=16)
    microbatches: int = opt(4, "stages > 1: micro-batches each replica's batch is cut into, which the stages work on "
                            "in turn (data.batch_size a multiple; 1..1024)", lo=1, hi=1024)
    schedule: str = opt("1f1b", "stages > 1: order of the micro-batches' forwards and backwards: 1f1b (one forward, "
                        "one backward: activations of at most `stages` micro-batches held) | gpipe (every forward, "
                        "then every backward)", choices=("1f1b", "gpipe"))
    balance: str = opt("time", "stages > 1: split points balance the layers' measured forward and backward time "
                       "(time) or their parameter counts (params)", choices=("time", "params"))
    split: list = opt([], "stages > 1: the layers where stages 2, 3, ... begin, by name (`scaletrain plan` lists "
                      "them; [] = chosen by parallel.balance)")


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    @property
    def distributed(self) -> bool:
        return self.cluster.nodes * self.cluster.gpus_per_node > 1 or self.cluster.num_ps > 0

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    def flat(self) -> dict[str, Any]:
        return {f"{s}.{k}": v for s, sec in self.to_dict().items() for k, v in sec.items()}

    def replace(self, **overrides: Any) -> "Config":
        """Copy with dotted overrides, e.g. cfg.replace(**{"train.steps": 5})."""
        return build_config(self.to_dict(), [f"{k}={toml_value(v)}" for k, v in overrides.items()])


SECTIONS = {f.name: f.type for f in fields(Config)}


def field_docs() -> dict[str, str]:
    """Every key with its one-line doc, for `scaletrain keys` and the README."""
    out = {}
    for sec in fields(Config):
        cls = get_type_hints(Config)[sec.name]
        for f in fields(cls):
            out[f"{sec.name}.{f.name}"] = f.metadata["doc"]
    return out


def toml_value(v: Any) -> str:
    if isinstance(v, dict):  # an inline table (model.args): tomli_w writes a dict as a table of its own
        keys = (tomli_w.dumps({k: 0}).rsplit("=", 1)[0].strip() for k in v)
        return "{" + ", ".join(f"{k} = {toml_value(x)}" for k, x in zip(keys, v.values())) + "}"
    return tomli_w.dumps({"v": v}).split("=", 1)[1].strip()


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. train.steps=100")
    key, raw = item.split("=", 1)
    key, raw = key.strip(), raw.strip()
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # a bare word such as crop+flip is a string
    return key.split("."), value


def check_value(key: str, value: Any, f: dataclasses.Field, typ: type) -> Any:
    allowed = f.metadata["doc"]
    if f.metadata["parse"] is not None:
        try:
            value = f.metadata["parse"](value)
        except ValueError as e:
            raise ConfigError(f"{key} = {value!r}: {e}") from None
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if typ is bool and not isinstance(value, bool) or typ is not bool and (
            isinstance(value, bool) or not isinstance(value, typ)):
        raise ConfigError(f"{key} = {value!r}: expected {typ.__name__} ({allowed})")
    if typ is float and not math.isfinite(value):
        # NaN passes every comparison of the range check below, and a job trains on it to the end
        raise ConfigError(f"{key} = {value!r}: expected a finite number ({allowed})")
    ch, lo, hi = f.metadata["choices"], f.metadata["lo"], f.metadata["hi"]
    if ch is not None and value not in ch:
        raise ConfigError(f"{key} = {value!r}: not allowed; choose one of {', '.join(ch)}")
    if lo is not None and value < lo or hi is not None and value > hi:
        raise ConfigError(f"{key} = {value!r}: out of range [{lo}, {hi}] ({allowed})")
    return value


def build_config(recipe: dict[str, Any], overrides: list[str] = (), origin: str = "recipe") -> Config:
    """Config from a nested dict plus KEY=VALUE overrides; raises ConfigError."""
    merged: dict[str, dict[str, Any]] = {}
    given: dict[str, str] = {}  # SECTION.KEY -> the --set that gave it: an error names that, not the recipe
    for sec, table in recipe.items():
        if sec not in SECTIONS:
            raise ConfigError(f"{origin}: unknown section [{sec}]; sections are {', '.join(SECTIONS)}")
        if not isinstance(table, dict):
            raise ConfigError(f"{origin}: [{sec}] must be a table of keys")
        merged[sec] = dict(table)
    hints = get_type_hints(Config)
    tables = {(s, k) for s in SECTIONS for k, t in get_type_hints(hints[s]).items() if t is dict}
    for item in overrides:
        path, value = _parse_override(item)
        if len(path) == 3 and tuple(path[:2]) in tables:  # one key of a table such as model.args
            table = merged.setdefault(path[0], {})
            sub = table.get(path[1])
            table[path[1]] = {**(sub if isinstance(sub, dict) else {}), path[2]: value}
            given[".".join(path[:2])] = item
            continue
        if len(path) != 2 or path[0] not in SECTIONS:
            raise ConfigError(f"--set {item!r}: key must be SECTION.KEY with SECTION one of "
                              f"{', '.join(SECTIONS)} (or {', '.join(f'{s}.{k}.NAME' for s, k in sorted(tables))})")
        merged.setdefault(path[0], {})[path[1]] = value
        given[".".join(path)] = item
    built = {}
    for sec, table in merged.items():
        cls = hints[sec]
        known = {f.name: f for f in fields(cls)}
        types = get_type_hints(cls)
        kw = {}
        for k, v in table.items():
            if k not in known:
                where = f"--set {given[f'{sec}.{k}']!r}" if f"{sec}.{k}" in given else origin
                raise ConfigError(f"unknown key {sec}.{k} in {where}; {sec} keys are {', '.join(known)}")
            kw[k] = check_value(f"{sec}.{k}", v, known[k], types[k])
        built[sec] = cls(**kw)
    cfg = Config(**built)
    check_relations(cfg)
    return cfg


def load_config(recipe: str | Path | None, overrides: list[str] = ()) -> Config:
    """Read a TOML recipe (or defaults when None) and apply overrides."""
    if recipe is None:
        return build_config({}, overrides)
    path = Path(recipe)
    tables = read_toml(path, "recipe")
    if not tables:
        # an empty file (or one of comments) is more likely a wrong or unsaved file than a wish for the defaults,
        # which a command gives with no recipe at all
        raise ConfigError(f"recipe {path} sets nothing (empty, or comments only); a recipe has tables such as "
                          "[model] and [train] (see recipes/)")
    return build_config(tables, overrides, origin=str(path))


def read_toml(path: Path, kind: str, error: type[ValueError] = ConfigError) -> dict[str, Any]:
    """The tables of a TOML file; `error` with one line naming the file when it cannot be read."""
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise error(f"{kind} {path} not found") from None
    except tomllib.TOMLDecodeError as e:
        raise error(f"{kind} {path}: not valid TOML: {e}") from None
    except IsADirectoryError:
        raise error(f"{kind} {path} is a directory; give a .toml file in it") from None
    except (OSError, UnicodeDecodeError) as e:
        raise error(f"{kind} {path} cannot be read: {getattr(e, 'strerror', None) or e}") from None


def dump_toml(cfg: Config) -> str:
    return tomli_w.dumps(cfg.to_dict())
