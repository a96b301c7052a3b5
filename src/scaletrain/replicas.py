"""What the replicas of a job hold apart and share at sync points: their BatchNorm
statistics (kept per replica between evaluations, saved per replica in checkpoints)
and the evaluation each does on its slice of the test set."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .compute import autocast
from .strategies.allreduce import average_


def _float_buffers(model: torch.nn.Module) -> list[torch.Tensor]:
    return [b for b in model.buffers() if b.is_floating_point()]


def replica_buffers(model: torch.nn.Module, group, workers: int, chief: int, is_chief: bool, numel: int | None = None,
                    own: list[torch.Tensor] = ()):
    """Every worker's floating buffers (BatchNorm statistics), then `own` (the strategy's
    replica_state: its optimizer state where replicas step alone), as flat tensors, on the chief
    (None elsewhere); a collective over the workers. numel: the size every worker's is padded to,
    where they differ (pipeline stages)."""
    bufs = _float_buffers(model) + list(own)
    flat = _flatten_dense_tensors(bufs) if bufs else torch.zeros(1, device=next(model.parameters()).device)
    if numel is not None:
        flat = torch.cat([flat[:numel], flat.new_zeros(numel - min(numel, flat.numel()))])
    out = [torch.empty_like(flat) for _ in range(workers)] if is_chief else None
    dist.gather(flat, out, dst=chief, group=group)  # collective over the workers
    return [t.cpu() for t in out] if is_chief else None


def load_replica_buffers(model: torch.nn.Module, saved: list[torch.Tensor] | None, index: int,
                         own: list[torch.Tensor] = ()) -> None:
    """Put back this replica's own buffers, and `own` as replica_buffers gathered it, from a checkpoint."""
    bufs = _float_buffers(model) + list(own)
    if not saved or not bufs or index >= len(saved):
        return
    with torch.no_grad():
        for b, v in zip(bufs, _unflatten_dense_tensors(saved[index].to(bufs[0].device), bufs)):
            b.copy_(v)


def evaluate(model: torch.nn.Module, loader, device: torch.device, inputs, group, workers: int,
             precision: str = "fp32", buffers_group=None, forward=None) -> dict[str, float]:
    """Test loss and accuracy over every worker's slice: each evaluates its own, the sums are
    reduced. BatchNorm statistics are averaged over the replicas first, so all evaluate one model.
    precision: train.precision; the forward autocasts as training's does, so the figures are of
    the model as it trains (and evaluation costs what a forward in training does). inputs: a
    loader's batch -> (x, y) on the device, (None, None) when none of its images could be read.
    With pipeline stages, `model` is this process's stage, its buffers averaged over `buffers_group`
    (the stage's replicas), and forward(x, n) the logits of the last stage (None on the others, whose
    sums stay 0)."""
    bgroup = buffers_group if forward is not None else group  # with stages, a stage's buffers are its own
    if bgroup is not None:
        bufs = [b for b in model.buffers() if b.is_floating_point()]
        if bufs:
            average_(bufs, bgroup, workers)  # collective over the replicas
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss, correct, images
    with torch.no_grad():
        for batch in loader:
            x, y = inputs(batch)
            if x is None:
                continue
            if forward is not None:
                logits = forward(x, len(y))
                if logits is None:
                    continue
            else:
                with autocast(precision, device):
                    logits = model(x)
            logits = logits.float()
            sums[0] += torch.nn.functional.cross_entropy(logits, y, reduction="sum")
            sums[1] += (logits.argmax(1) == y).sum()
            sums[2] += len(y)
    model.train()
    if group is not None:
        dist.all_reduce(sums, group=group)  # collective over the workers
    loss, correct, n = sums.tolist()  # host-device sync, once per evaluation
    if n == 0:
        return {}
    return {"test_loss": loss / n, "test_accuracy": correct / n, "test_images": int(n)}
