"""How the keys of a config must agree with one another (config.py checks each key on its own first).

Each check raises ConfigError with one line that names the key, its value and what it must agree
with, before any process starts.
"""

from __future__ import annotations

from .device import refused
from .errors import ConfigError
from .recipe_values import MODELS, SOURCES
from .strategies.traits import REGISTRY

ROOTS = {name: root for name, root in SOURCES.items() if root}  # the sources that read data.root
STOP_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGINT", "SIGQUIT", "SIGXCPU")


def check_relations(cfg) -> None:
    """The keys of a config that must agree with one another; ConfigError names the first that does not."""
    d = cfg.data
    if d.name in ROOTS and not d.root:
        raise ConfigError(f"data.root is empty: data.name = {d.name!r} needs a {ROOTS[d.name]}")
    if d.args and d.name in SOURCES:
        raise ConfigError(f"data.args = {d.args!r}: the keyword arguments of a factory (data.name = "
                          f"package.module:factory); data.name = {d.name!r} takes none")
    for key in ("root", "test_root"):
        if getattr(d, key) and d.name not in SOURCES:
            raise ConfigError(f"data.{key} = {getattr(d, key)!r}: data.name = {d.name!r} reads no files of its own; "
                              "give the factory its paths in [data.args]")
    if cfg.optim.scale_lr == "noise" and not cfg.optim.noise_scale > 0:
        raise ConfigError("optim.scale_lr = 'noise' needs optim.noise_scale > 0: a measured run's noise_scale "
                          "(summary.json)")
    if cfg.train.steps == 0 and cfg.train.epochs <= 0:
        raise ConfigError("train.steps = 0 and train.epochs = 0: set one of them above 0")
    s, c = cfg.strategy, cfg.cluster
    if REGISTRY[s.name].backups and s.backup_workers >= c.nodes:
        raise ConfigError(f"strategy.backup_workers = {s.backup_workers}: must be below cluster.nodes = {c.nodes} "
                          "(a version needs at least one node's gradient)")
    stale_aware = [f"strategy.{k} = {v}" for k, v in (("staleness_lr", s.staleness_lr),
                                                      ("delay_compensation", s.delay_compensation))
                   if v not in ("none", 0.0)]
    if stale_aware and not s.emulate_workers and REGISTRY[s.name].server != "async":
        names = " or ".join(n for n, e in REGISTRY.items() if e.server == "async")
        raise ConfigError(f"{' and '.join(stale_aware)}: acts on asynchronous updates, those of strategy.name = "
                          f"{names} or of strategy.emulate_workers; strategy.name = {s.name!r}")
    if s.compression != "none" and (REGISTRY[s.name].rounds or s.emulate_workers):
        names = ", ".join(n for n, e in REGISTRY.items() if not e.rounds)
        raise ConfigError(f"strategy.compression = {s.compression}: acts between the nodes of strategy.name = {names}; "
                          f"not {s.name!r}{' with strategy.emulate_workers' if s.emulate_workers else ''}")
    if s.async_bound and not REGISTRY[s.name].rounds:
        names = " or ".join(n for n, e in REGISTRY.items() if e.rounds)
        raise ConfigError(f"strategy.async_bound = {s.async_bound}: bounds the rounds of strategy.name = {names}; "
                          f"strategy.name = {s.name!r} has none (set it to 0)")
    local = REGISTRY[s.name].local
    for key, reader in (("sync_every", ""), ("outer_lr", "outer"), ("outer_momentum", "outer")):
        if getattr(s, key) != type(s).__dataclass_fields__[key].default and not (local and reader in ("", local)):
            names = " or ".join(n for n, e in REGISTRY.items() if e.local and reader in ("", e.local))
            raise ConfigError(f"strategy.{key} = {getattr(s, key)}: read by strategy.name = {names} only; "
                              f"strategy.name = {s.name!r}")
    if local and cfg.train.ema_decay:
        raise ConfigError(f"train.ema_decay = {cfg.train.ema_decay}: averages the job's weights after every update; "
                          f"under strategy.name = {s.name!r} each replica holds its own between meetings")
    if local and s.emulate_workers:
        raise ConfigError(f"strategy.emulate_workers = {s.emulate_workers}: emulates asynchronous workers in one "
                          f"process; strategy.name = {s.name!r} runs its replicas as processes")
    if refused(cfg):
        raise ConfigError(refused(cfg)[0])
    if s.emulate_workers and cfg.distributed:
        raise ConfigError(f"strategy.emulate_workers = {s.emulate_workers} runs in one process: set "
                          "cluster.nodes = cluster.gpus_per_node = 1 and cluster.num_ps = 0")
    t = cfg.train
    if t.emulate_compute_s:
        for key, value in (("target_accuracy", t.target_accuracy), ("target_loss", t.target_loss),
                           ("eval_every", t.eval_every)):
            if value:
                raise ConfigError(f"train.{key} = {value}: train.emulate_compute_s = {t.emulate_compute_s} trains on "
                                  f"made-up gradients, so nothing is evaluated; set train.{key} = 0")
        for key, value in (("data.mixup_alpha", d.mixup_alpha), ("data.cutmix_alpha", d.cutmix_alpha),
                           ("train.label_smoothing", t.label_smoothing)):
            if value:
                raise ConfigError(f"{key} = {value}: train.emulate_compute_s = {t.emulate_compute_s} reads no data "
                                  f"to mix or smooth; set {key} = 0")
    if (t.target_accuracy or t.target_loss) and not t.eval_every:
        raise ConfigError("train.target_accuracy / train.target_loss are checked at evaluations: "
                          "set train.eval_every > 0")
    for name in c.stopping:
        if name not in STOP_SIGNALS:
            raise ConfigError(f"cluster.stop_signals = {c.stop_signals!r}: {name!r} is not one of "
                              f"{', '.join(STOP_SIGNALS)}")
    if s.slow_node >= c.nodes:
        raise ConfigError(f"strategy.slow_node = {s.slow_node}: no such node (cluster.nodes = {c.nodes})")
    if c.network != "netns":
        for key, value, unset in (("time_scale", c.time_scale, 1.0), ("slow_link_node", c.slow_link_node, -1)):
            if value != unset:
                raise ConfigError(f"cluster.{key} = {value}: acts in the cluster twin only; set cluster.network = netns")
    if c.slow_link_node >= c.nodes:
        raise ConfigError(f"cluster.slow_link_node = {c.slow_link_node}: no such node (cluster.nodes = {c.nodes})")
    if c.time_scale != 1 and not t.emulate_compute_s:
        raise ConfigError(f"cluster.time_scale = {c.time_scale}: dilates emulated compute only; set "
                          "train.emulate_compute_s > 0 (the step time of the GPU the twin stands for)")
    if c.survive_loss:
        _check_survive(cfg)
    if c.after_loss != "scale-lr" and not (c.survive_loss and REGISTRY[cfg.strategy.name].heals):
        able = ", ".join(n for n, t in REGISTRY.items() if t.heals)
        raise ConfigError(f"cluster.after_loss = {c.after_loss!r}: acts where the replicas' group re-forms in place: "
                          f"set cluster.survive_loss = true, with strategy {able}")
    if c.replacements and not (c.survive_loss and REGISTRY[cfg.strategy.name].heals):
        able = ", ".join(n for n, t in REGISTRY.items() if t.heals)
        raise ConfigError(f"cluster.replacements = {c.replacements}: a replacement joins a job that goes on in place "
                          f"and heals from a live replica: set cluster.survive_loss = true, with strategy {able}")
    if c.min_nodes > c.nodes:
        raise ConfigError(f"cluster.min_nodes = {c.min_nodes}: above cluster.nodes = {c.nodes}")
    _check_model(cfg.model)
    _check_stages(cfg)
    if cfg.model.name == "resnet50" and cfg.data.image_size < 32:
        raise ConfigError(f"data.image_size = {cfg.data.image_size}: resnet50 needs at least 32 pixels")


def _check_survive(cfg) -> None:
    """cluster.survive_loss with what it composes with: a strategy that re-forms or goes on anyway,
    whole replicas (a ring of stages is not built), real processes (not emulated workers)."""
    e, name = REGISTRY[cfg.strategy.name], cfg.strategy.name
    if not (e.reforms or e.survives_loss):
        able = ", ".join(n for n, t in REGISTRY.items() if t.reforms or t.survives_loss)
        raise ConfigError(f"cluster.survive_loss = true: strategy {name} cannot go on without a lost node "
                          f"(its replicas meet on steps of their own); these can: {able}")
    if cfg.cluster.nodes < 2:
        raise ConfigError("cluster.survive_loss = true: a job of one node has no node to go on without (the "
                          "chief's never is); set cluster.nodes >= 2")
    if cfg.parallel.stages > 1:
        raise ConfigError(f"cluster.survive_loss = true: with parallel.stages = {cfg.parallel.stages} a lost "
                          "stage leaves its replica unable to step; set parallel.stages = 1")
    if cfg.strategy.emulate_workers:
        raise ConfigError("cluster.survive_loss = true: strategy.emulate_workers runs one process, which has "
                          "no node to lose")


def _check_stages(cfg) -> None:
    """parallel.* with what it composes with: the strategies whose traits say so, real compute."""
    p, c = cfg.parallel, cfg.cluster
    if p.stages == 1:
        return
    if c.gpus_per_node % p.stages:
        raise ConfigError(f"cluster.gpus_per_node = {c.gpus_per_node}: a replica takes parallel.stages = {p.stages} "
                          f"processes of a node; set it to a multiple of {p.stages}")
    if cfg.data.batch_size % p.microbatches:
        raise ConfigError(f"data.batch_size = {cfg.data.batch_size}: not a multiple of parallel.microbatches = "
                          f"{p.microbatches}")
    if p.split and len(p.split) != p.stages - 1:
        raise ConfigError(f"parallel.split = {p.split!r}: names the first layer of stages 2..{p.stages}, "
                          f"{p.stages - 1} names")
    if REGISTRY[cfg.strategy.name].uses_ps and REGISTRY[cfg.strategy.name].stages and c.num_ps % p.stages:
        raise ConfigError(f"cluster.num_ps = {c.num_ps}: each of parallel.stages = {p.stages} has shards of its own "
                          f"(shard k holds stage k mod {p.stages}'s parameters); set it to a multiple of {p.stages}")
    if not REGISTRY[cfg.strategy.name].stages:
        names = " or ".join(n for n, e in REGISTRY.items() if e.stages)
        raise ConfigError(f"parallel.stages = {p.stages}: composes with strategy.name = {names}; not "
                          f"{cfg.strategy.name!r}, whose replicas {REGISTRY[cfg.strategy.name].no_stages}")
    t, s = cfg.train, cfg.strategy
    for key, value in (("train.emulate_compute_s", t.emulate_compute_s), ("strategy.emulate_workers",
                       s.emulate_workers), ("train.noise_every", t.noise_every), ("train.compile", t.compile),
                       ("train.channels_last", t.channels_last)):
        if value:
            raise ConfigError(f"{key} = {value}: not with parallel.stages = {p.stages}, whose forward and backward "
                              "are the pipeline schedule's (set parallel.stages = 1 or turn it off)")
    if t.grad_accum_steps > 1:
        raise ConfigError(f"train.grad_accum_steps = {t.grad_accum_steps}: not with parallel.stages = {p.stages}, "
                          "whose schedule already splits a batch into parallel.microbatches; raise those instead")


def _check_model(m) -> None:
    """Keys that shape only one kind of network are errors with the other (no setting silently ignored)."""
    if m.name in MODELS:
        if m.args:
            raise ConfigError(f"model.args = {m.args!r}: the keyword arguments of an import-path model.name's "
                              f"factory; model.name = {m.name!r} is built-in (model.norm and model.width shape it)")
        return
    default = type(m)()
    for key in ("norm", "width"):
        if getattr(m, key) != getattr(default, key):
            raise ConfigError(f"model.{key} = {getattr(m, key)!r}: shapes the built-in ResNets only; model.name = "
                              f"{m.name!r} is your own network (give its factory's options in [model.args])")
