"""Where a replica's network is split into pipeline stages (pipeline.py runs them): its layers, the
split points (balanced by cost, or named by parallel.split), and the split `scaletrain plan` and the
performance model show, made on the meta device."""

from __future__ import annotations

import torch
from torch import nn

from .errors import ConfigError
from .models import build_model


def layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The network's layers in the order a forward applies them."""
    made = getattr(model, "pipeline_layers", None)
    if callable(made):
        return list(made())
    if isinstance(model, nn.Sequential):
        return list(model.named_children())
    raise ConfigError(f"parallel.stages > 1: {type(model).__name__} cannot be split into stages: give it a method "
                      "pipeline_layers() returning its (name, module) layers in forward order, or build it as a "
                      "torch.nn.Sequential (docs/pipeline.md)")


def balance(costs: list[float], stages: int) -> list[int]:
    """The first layer of each stage (0 first) of the contiguous split of `costs` into `stages` parts
    whose largest sum is smallest (a pipeline runs at the pace of its slowest stage); ties go to the
    split with the earliest points. Exact, by dynamic programming: O(stages x layers^2)."""
    n = len(costs)
    if n < stages:
        raise ConfigError(f"parallel.stages = {stages}: the network has {n} layers to split")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: the smallest largest part over splits of the first i layers into k parts
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                v = max(best[k - 1][j], prefix[i] - prefix[j])
                if v < best[k][i] - 1e-12 * max(1.0, abs(v)):
                    best[k][i], cut[k][i] = v, j
    starts, i = [], n
    for k in range(stages, 0, -1):
        i = cut[k][i]
        starts.append(i)
    return starts[::-1]


def stage_module(model: nn.Module, starts: list[int], stage: int) -> nn.Module:
    """The layers of one stage of a split (starts: the first layer of each stage), as one module."""
    mods = [m for _, m in merge_in_place(layers(model))]
    return nn.Sequential(*mods[starts[stage]:(starts + [len(mods)])[stage + 1]])


def named_starts(names: list[str], split: list[str]) -> list[int]:
    """parallel.split's names as the first layer of stages 2, 3, ..."""
    starts = [0]
    for name in split:
        if name not in names:
            raise ConfigError(f"parallel.split: no layer {name!r}; the layers are {', '.join(names)}")
        i = names.index(name)
        if i <= starts[-1]:
            raise ConfigError(f"parallel.split = {split!r}: {name!r} does not come after the previous split point "
                              "(the names go in forward order, each stage at least one layer)")
        starts.append(i)
    return starts


def meta_split(cfg) -> tuple[list[str], list[int], list[int], list[nn.Module]]:
    """(layer names, their parameters, the first layer of each stage, the layers) of the recipe's network
    as a run splits it without measuring: by parallel.split, else by parameters. The network is built on
    the meta device: no memory, no compute (its layers run on meta tensors for shapes)."""
    with torch.device("meta"):
        named = merge_in_place(layers(build_model(cfg.model, weights=False)))
    names, params = [n for n, _ in named], [sum(q.numel() for q in m.parameters()) for _, m in named]
    p = cfg.parallel
    starts = named_starts(names, p.split) if p.split else balance([float(n) for n in params], p.stages)
    return names, params, starts, [m for _, m in named]


def planned_split(cfg) -> str:
    """The layers of the recipe's network and the stages parallel.split or a split by parameters makes of
    them, for `scaletrain plan` (a run with parallel.balance = time splits by the times it measures, and
    its summary.json says where)."""
    names, params, starts, _ = meta_split(cfg)
    p = cfg.parallel
    how = "parallel.split" if p.split else "parameters" + (
        " (the run splits by the layers' measured times, parallel.balance = time: its summary.json says where)"
        if p.balance == "time" else "")
    lines = [f"{p.stages} stages, by {how}; {p.microbatches} micro-batches a batch, {p.schedule}:"]
    for k, (a, b) in enumerate(zip(starts, [*starts[1:], len(names)])):
        lines.append(f"  stage {k + 1}: {names[a]} .. {names[b - 1]} ({b - a} layers, {sum(params[a:b]):,} parameters)")
    lines.append(f"layers (parallel.split names where stages 2.. begin): {', '.join(names)}")
    return "\n".join(lines)


def merge_in_place(named: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """An in-place layer (ReLU(inplace=True)) joins the layer before it: a stage's input is a leaf
    that autograd must keep, which an in-place first layer would overwrite."""
    out: list[tuple[str, nn.Module]] = []
    for name, m in named:
        if out and getattr(m, "inplace", False):
            out[-1] = (out[-1][0], nn.Sequential(out[-1][1], m))
        else:
            out.append((name, m))
    return out
