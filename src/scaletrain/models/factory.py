"""The network a model.name names: a built-in ResNet, or your own by import path.

An import path is "package.module:factory", "torchvision:NAME" or "timm:NAME". The factory is
called as factory(num_classes=model.num_classes, **model.args) and must return a torch.nn.Module
whose output for a batch of images is (batch, num_classes). torchvision and timm are optional
extras: imported here only when a name asks for one, never at module level (the core runs without
them: torchvision has no CPU build on the project's machines).

Every way such a name can fail is a ModelNameError of one line naming model.name. The launcher
builds the network once, on CPU, before it starts any process (check_network), so that the error
is found there and not in a process's log.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from ..recipe_values import MODEL_EXTRAS, MODELS
from ..errors import ModelNameError
from ..imports import import_path, one_line
from .resnet import resnet

# A dummy batch of 2, not 1: an output that lost its batch dimension (a squeeze) shows.
CHECK_BATCH = 2


def build_network(cfg) -> nn.Module:
    """The freshly initialised network of a ModelConfig (no pretrained weights)."""
    if cfg.name in MODELS:
        return resnet(cfg.name, cfg.num_classes, cfg.norm, cfg.width)
    prefix, _, attr = cfg.name.partition(":")
    factory, said = _extra(cfg, prefix, attr) if prefix in MODEL_EXTRAS else _lookup(cfg, prefix, attr)
    call = f"{said}num_classes={cfg.num_classes}{''.join(f', {k}={v!r}' for k, v in cfg.args.items())})"
    try:
        model = factory(num_classes=cfg.num_classes, **cfg.args)
    except Exception as e:  # noqa: BLE001 - the user's code: any error is its message, in one line
        raise ModelNameError(f"{_where(cfg)}: {call} raised {one_line(e)}") from None
    if not isinstance(model, nn.Module):
        raise ModelNameError(f"{_where(cfg)}: {call} returned a {type(model).__name__}, not a torch.nn.Module")
    return model


def check_network(cfg) -> None:
    """Raise the ModelNameError a job's processes would meet with a Config's network: build it once
    on CPU and run one dummy batch of data.image_size through it, in training mode as the job will.
    Nothing to do for a built-in network. The global random state is left as it was."""
    m, side = cfg.model, cfg.data.image_size
    if m.name in MODELS:
        return
    with torch.random.fork_rng(devices=[]):
        model = build_network(m).train()
        what = f"a batch of {CHECK_BATCH} images of 3x{side}x{side} (data.image_size = {side})"
        try:
            with torch.no_grad():
                out = model(torch.zeros(CHECK_BATCH, 3, side, side))
        except Exception as e:  # noqa: BLE001 - the user's code: any error is its message, in one line
            raise ModelNameError(f"{_where(m)}: the network's forward of {what} raised {one_line(e)}") from None
    want = (CHECK_BATCH, m.num_classes)
    if not isinstance(out, torch.Tensor):
        raise ModelNameError(f"{_where(m)}: the network's output for {what} is a {type(out).__name__}; "
                             f"training needs a tensor of {want}: (batch, model.num_classes)")
    if tuple(out.shape) != want:
        raise ModelNameError(f"{_where(m)}: the network's output for {what} has shape {tuple(out.shape)}; "
                             f"training needs {want}: (batch, model.num_classes)")


def _where(cfg) -> str:
    return f"model.name = {cfg.name!r}"


def _lookup(cfg, module: str, attr: str):
    """The factory module:attr (attr may be dotted, e.g. Class.method) and the start of its call, as
    an error names it."""
    # A module may draw random numbers as it is imported (a network made at its top level): the
    # seeded initialisation that follows must not depend on whether this process imported it before.
    with torch.random.fork_rng(devices=[]):
        obj = import_path("model.name", f"{module}:{attr}", ModelNameError)
    if isinstance(obj, nn.Module) or not callable(obj):
        raise ModelNameError(f"{_where(cfg)}: {module}:{attr} is a {type(obj).__name__}, not a factory (a class "
                             "or function that takes num_classes= and returns a torch.nn.Module)")
    return obj, f"{cfg.name}("


def _extra(cfg, package: str, name: str):
    """torchvision's or timm's constructor of the network NAME, and the start of its call."""
    try:
        if package == "torchvision":
            import torchvision.models  # optional extra: scaletrain[torchvision]
            return partial(torchvision.models.get_model, name), f"torchvision.models.get_model({name!r}, "
        import timm  # optional extra: scaletrain[timm]
        return partial(timm.create_model, name), f"timm.create_model({name!r}, "
    except Exception as e:  # noqa: BLE001 - missing, or installed but broken (e.g. built for another torch)
        raise ModelNameError(f"{_where(cfg)} needs the {package} package, which does not import here "
                             f"({one_line(e)}): pip install 'scaletrain[{package}]'") from None
