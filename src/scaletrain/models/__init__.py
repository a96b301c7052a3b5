"""Model construction (factory.py: built-in or by import path) and pretrained-weight loading."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from ..checkpoint import read
from ..errors import CheckpointError, PretrainedError
from .factory import build_network, check_network
from .resnet import ResNet

__all__ = ["ResNet", "build_model", "check_network", "load_pretrained", "final_layer", "PretrainedError"]

log = logging.getLogger(__name__)


def build_model(cfg, weights: bool = True) -> nn.Module:
    """The network of a ModelConfig, with pretrained weights when init_from is set (and `weights`)."""
    model = build_network(cfg)
    if weights and cfg.init_from:
        load_pretrained(model, cfg.init_from, cfg.num_classes)
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


def final_layer(model: nn.Module) -> str | None:
    """The name of the model's final layer: the module that holds its last parameter, in the order
    the modules were made (named_parameters'): "fc" for the ResNets. '' when the model itself holds
    it; None without parameters."""
    names = [name for name, _ in model.named_parameters()]
    return names[-1].rpartition(".")[0] if names else None


def load_pretrained(model: nn.Module, path: str | Path, num_classes: int | None = None) -> list[str]:
    """Copy weights from `path` into `model`; returns the names re-initialised.

    One mismatch is allowed, that of a classifier trained for another class count: a tensor of the
    final layer (final_layer) whose shape differs from the model's in its first dimension only (a
    Linear's out_features, a convolution's out_channels), where the model has num_classes (when
    given). It keeps the model's fresh initialisation and is reported. Any other missing,
    unexpected or mis-shaped tensor is an error naming it.
    """
    path = Path(path)
    src = _read_state(path)
    own = model.state_dict()
    head = final_layer(model)

    def classes_only(k: str) -> bool:
        a, b = src[k].shape, own[k].shape
        return (head is not None and k.rpartition(".")[0] == head and len(a) == len(b) >= 1 and a[1:] == b[1:]
                and (num_classes is None or b[0] == num_classes))

    reinit = [k for k in own if k in src and src[k].shape != own[k].shape and classes_only(k)]
    for k in own:
        if k in reinit:
            continue
        if k not in src:
            raise PretrainedError(f"model.init_from: {path} lacks tensor {k!r} {tuple(own[k].shape)}")
        if src[k].shape != own[k].shape:
            raise PretrainedError(f"model.init_from: tensor {k!r} has shape {tuple(src[k].shape)} in {path}, "
                                  f"model needs {tuple(own[k].shape)} (only the final layer's class dimension "
                                  "may differ)")
    extra = sorted(set(src) - set(own))
    if extra:
        raise PretrainedError(f"model.init_from: {path} has tensor {extra[0]!r} the model does not"
                              + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))
    model.load_state_dict({k: v for k, v in src.items() if k not in reinit}, strict=False)
    if reinit:
        log.warning("model.init_from: classifier head %s re-initialised (%s in %s, %s in the model)",
                    ", ".join(reinit), tuple(src[reinit[0]].shape), path, tuple(own[reinit[0]].shape))
    return reinit
