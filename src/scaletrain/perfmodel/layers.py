"""What one training step of a network costs, counted on the meta device (no memory, no compute).

Every aten operator of a forward and backward pass is recorded with its FLOPs (torch's own
formulas, torch.utils.flop_counter) and the bytes it reads and writes (its tensor arguments and
results; views move none). A GPU's step time follows from these per operator (gpus.py: each takes
the longer of its FLOPs at the GPU's peak and its bytes at the memory's bandwidth), which is what
lets one achieved-rate factor per GPU carry from ResNet-50 to a network of grouped or depthwise
convolutions that the FLOPs alone would call fast.

The tensors autograd keeps for the backward pass are counted too: the activations one image
holds on the device while its step runs (memory_per_image of a profile).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from ..errors import ModelError
from ..models.factory import build_network
from ..imports import one_line


@dataclass(frozen=True)
class Op:
    name: str
    flops: float
    bytes: float


@dataclass(frozen=True)
class StepCost:
    """One forward + backward pass of `batch` images, as the device sees it."""

    batch: int
    ops: tuple[Op, ...]
    saved_bytes: int     # tensors kept for the backward pass (activations, and weights autograd holds)
    parameters: int

    @property
    def flops(self) -> float:
        return sum(o.flops for o in self.ops)

    @property
    def bytes(self) -> float:
        return sum(o.bytes for o in self.ops)


class _Record(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[Op] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        flops = flop_registry[packet](*args, **kwargs, out_val=out) if packet in flop_registry else 0
        moved = 0 if func.is_view else sum(t.nbytes for t in tree_flatten((args, kwargs, out))[0]
                                          if isinstance(t, torch.Tensor))
        self.ops.append(Op(str(packet), float(flops), float(moved)))
        return out


def step_cost(model_cfg, image_size: int, batch: int, half: bool = False) -> StepCost:
    """The operators of one training step of `batch` images of `image_size` px through the network
    of `model_cfg` (a ModelConfig), in bf16 when `half` (autocast keeps activations in 16 bits), and
    the bytes autograd saves for the backward pass. ModelError in one line when the network does not
    build or run on the meta device."""
    dtype = torch.bfloat16 if half else torch.float32
    saved: dict[int, int] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()  # one storage saved twice (an output two operators need) counts once
        saved[storage._cdata] = max(saved.get(storage._cdata, 0), storage.nbytes())
        return t

    try:
        with torch.device("meta"):
            model = build_network(model_cfg).to(dtype)
        record = _Record()
        x = torch.empty(batch, 3, image_size, image_size, device="meta", dtype=dtype)
        with record:
            with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
                loss = model(x).float().sum()
            loss.backward()
    except ModelError:
        raise
    except Exception as e:  # noqa: BLE001 - a user's network that will not run on meta: say which and why
        raise ModelError(f"model.name = {model_cfg.name!r}: cannot count its layers on the meta device "
                         f"({one_line(e)}); give a measured point for it (a cluster description's [measured])") from None
    params = sum(p.numel() for p in model.parameters())
    return StepCost(batch, tuple(record.ops), sum(saved.values()), params)
