"""An engine's side of replica groups that run as independent torch jobs (``fault=torchft``):
after the strategy's own reduction inside its group, each rank's gradients are averaged with the
same rank of every other group in the step's quorum, in one flat buffer
(:class:`plait.types.ReplicaSync` does the averaging); the step's loss travels in the same buffer,
so a step costs one collective across the groups, not two. With FSDP a rank's gradients are its
shards (DTensors' local parts): the same rank of every group holds the same shards."""

from __future__ import annotations

from typing import Iterable

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from plait.types import ReplicaSync


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a view), else the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def average_over_replicas(
    replicas: ReplicaSync, params: Iterable[torch.nn.Parameter], *values: torch.Tensor
) -> None:
    """Average every gradient this rank holds, and ``values`` (e.g. the step's loss), over the
    replica groups of the step's quorum, in place, in one collective per dtype."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for value in values:
        by_dtype.setdefault(value.dtype, []).append(value)
    for param in params:
        if param.grad is not None:
            grad = local_part(param.grad)
            by_dtype.setdefault(grad.dtype, []).append(grad)
    for grads in by_dtype.values():
        flat = replicas.average(_flatten_dense_tensors(grads))
        for grad, averaged in zip(grads, _unflatten_dense_tensors(flat, grads)):
            grad.copy_(averaged)


def average_value(replicas: ReplicaSync | None, value: float, device: torch.device) -> float:
    """``value`` (this group's, e.g. its mean loss) averaged over the groups of the step's
    quorum; unchanged when the job runs as one."""
    if replicas is None:
        return value
    return float(replicas.average(torch.tensor([value], dtype=torch.float64, device=device)))
