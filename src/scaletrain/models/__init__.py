"""Model construction and pretrained-weight loading."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from ..checkpoint import read
from ..errors import CheckpointError, PretrainedError
from .resnet import ResNet, resnet

__all__ = ["ResNet", "build_model", "load_pretrained", "PretrainedError", "HEAD_PREFIX"]

log = logging.getLogger(__name__)
HEAD_PREFIX = "fc."  # the classifier head: re-initialised when its size differs


def build_model(cfg) -> nn.Module:
    """The network of a ModelConfig, with pretrained weights when init_from is set."""
    model = resnet(cfg.name, cfg.num_classes, cfg.norm, cfg.width)
    if cfg.init_from:
        load_pretrained(model, cfg.init_from)
    return model


def _read_state(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise PretrainedError(f"model.init_from: {path} does not exist")
    if path.suffix == ".safetensors":
        try:
            return load_file(str(path))
        except Exception:  # noqa: BLE001 - the library's text names no file
            raise PretrainedError(f"model.init_from: {path} is not a readable safetensors file "
                                  "(truncated or corrupt)") from None
    try:
        obj = read(path)  # weights_only: a pickle can run code; a state dict never needs to
    except CheckpointError as e:
        raise PretrainedError(f"model.init_from: {e}") from None
    for key in ("state_dict", "model"):  # common checkpoint wrappers
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise PretrainedError(f"model.init_from: {path} holds no state dict of tensors")
    return {k.removeprefix("module."): v for k, v in obj.items()}


def load_pretrained(model: nn.Module, path: str | Path) -> list[str]:
    """Copy weights from `path` into `model`; returns the names re-initialised.

    A classifier head of another shape (another class count) keeps the
    model's fresh initialisation and is reported; any other missing,
    unexpected or mis-shaped tensor is an error naming it.
    """
    path = Path(path)
    src = _read_state(path)
    own = model.state_dict()
    reinit = [k for k in own if k.startswith(HEAD_PREFIX) and k in src and src[k].shape != own[k].shape]
    for k in own:
        if k in reinit:
            continue
        if k not in src:
            raise PretrainedError(f"model.init_from: {path} lacks tensor {k!r} {tuple(own[k].shape)}")
        if src[k].shape != own[k].shape:
            raise PretrainedError(f"model.init_from: tensor {k!r} has shape {tuple(src[k].shape)} in {path}, "
                                  f"model needs {tuple(own[k].shape)}")
    extra = sorted(set(src) - set(own))
    if extra:
        raise PretrainedError(f"model.init_from: {path} has tensor {extra[0]!r} the model does not"
                              + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))
    model.load_state_dict({k: v for k, v in src.items() if k not in reinit}, strict=False)
    if reinit:
        log.warning("model.init_from: classifier head %s re-initialised (%s in %s, %s in the model)",
                    ", ".join(reinit), tuple(src[reinit[0]].shape), path, tuple(own[reinit[0]].shape))
    return reinit
