"""The network a model.name names: a built-in ResNet, or your own by import path.

An import path is "package.module:factory", "torchvision:NAME" or "timm:NAME". The factory is
called as factory(num_classes=model.num_classes, **model.args) and must return a torch.nn.Module
whose output for a batch of images is (batch, num_classes). torchvision and timm are optional:
imported here only when a name asks for one, never at module level (the core runs without them:
torchvision has no CPU build on the project's machines). A torchvision works only with the torch
it was built for, so where one is missing or built for another torch the error gives the command
that installs the matching one and keeps the torch there (extra_error).

Every way such a name can fail is a ModelNameError of one line naming model.name. The launcher
builds the network once, on CPU, before it starts any process (check_network), so that the error
is found there and not in a process's log.
"""

from __future__ import annotations

import re
from functools import partial

import torch
from torch import nn
from torch.nn.modules.lazy import LazyModuleMixin

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
    lazy = next(((n, mod) for n, mod in model.named_modules() if isinstance(mod, LazyModuleMixin)), None)
    if lazy:  # its parameters have no shape yet: nothing to average, shard, count or load before a forward
        name, mod = lazy
        raise ModelNameError(f"{_where(cfg)}: {call} has a lazy module, {name or 'the network'} "
                             f"({type(mod).__name__}), whose parameters take their shape at its first forward; every "
                             "replica and parameter server needs them from the start: give its sizes (e.g. "
                             "nn.Linear(in_features, out_features))")
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
            import torchvision.models  # optional: only a torchvision: name needs it
            return partial(torchvision.models.get_model, name), f"torchvision.models.get_model({name!r}, "
        import timm  # optional: only a timm: name needs it
        return partial(timm.create_model, name), f"timm.create_model({name!r}, "
    except Exception as e:  # noqa: BLE001 - missing, or installed but broken (e.g. built for another torch)
        raise ModelNameError(f"{_where(cfg)} {extra_error(package, e, torch.__version__)}") from None


def torchvision_for(torch_version: str) -> str | None:
    """The torchvision release series built for a torch release ("2.13.0+cu128" -> "0.28"): since torch
    2.0 (torchvision 0.15) each torch minor has its own torchvision minor, 15 above. None for a torch
    the rule does not know."""
    m = re.match(r"(\d+)\.(\d+)", torch_version)
    if not m or int(m[1]) != 2:
        return None
    return f"0.{int(m[2]) + 15}"


def torch_index(torch_version: str) -> str | None:
    """The package index of PyTorch's builds of a torch with a local tag (+cpu, +cu128, +rocm6.4), where
    its matching torchvision is; None for PyPI's own build (no tag)."""
    tag = torch_version.partition("+")[2]
    return f"https://download.pytorch.org/whl/{tag}" if re.fullmatch(r"cpu|cu\d+|rocm[\d.]+", tag) else None


def extra_command(packages: list[str], torch_version: str, replace_torchvision: bool = False, pip: str = "pip") -> str:
    """One command line installing `packages` (torchvision, timm) against the torch installed, never
    replacing it: that torch's own version is a requirement pip finds met, beside the torchvision made
    for it, from PyTorch's index of that build (a torchvision of PyPI's is built for PyPI's torch).
    replace_torchvision: uninstall the torchvision there first (one built for another torch). pip: the
    command that runs pip (e.g. "/path/python -m pip")."""
    tv = torchvision_for(torch_version)
    wanted = [*(["timm"] if "timm" in packages else []), f"'torchvision=={tv}.*'" if tv else "torchvision",
              f"'torch=={torch_version}'"]
    index = torch_index(torch_version)
    return (f"{pip} uninstall -y torchvision && " if replace_torchvision else "") + \
        f"{pip} install {' '.join(wanted)}" + (f" --extra-index-url {index}" if index else "")


def extra_error(package: str, error: BaseException, torch_version: str) -> str:
    """Why a torchvision: or timm: name cannot be built here, and the one command line that fixes it,
    keeping the torch there: the package (or the torchvision timm imports) is not installed, or it is
    but does not import against this torch (a torchvision built for another torch says "operator
    torchvision::nms does not exist")."""
    tv = torchvision_for(torch_version)
    made_for = f"torchvision {tv}" if tv else "the torchvision release made for it"
    if isinstance(error, ModuleNotFoundError) and (error.name or "").split(".")[0] in (package, "torchvision"):
        return (f"needs {error.name.split('.')[0]}, which is not installed; for torch {torch_version} ({made_for}), "
                f"keeping that torch: {extra_command([package], torch_version)}")
    return (f"needs {package}, which is installed but does not import against torch {torch_version} "
            f"({one_line(error)}): that torch needs {made_for}, built for it; keeping that torch: "
            f"{extra_command([package], torch_version, replace_torchvision=True)}")
