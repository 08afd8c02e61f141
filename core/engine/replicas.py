"""An engine's side of replica groups that run as independent torch jobs (``fault=torchft``):
after the strategy's own reduction inside its group, each rank's gradients are averaged with the
same rank of every other group in the step's quorum, in one flat buffer
(:class:`plait.types.ReplicaSync` does the averaging); the step's loss travels in the same buffer,
so a step costs one collective across the groups, not two.

Plain gradients live in that buffer between steps, as views of it (what DDP's
``gradient_as_bucket_view`` does with its buckets): the backward accumulates into it, the
average is done in place, and zeroing it replaces ``zero_grad``, so a step copies no gradient and
allocates no buffer. With FSDP a rank's gradients are its shards (DTensors' local parts, the same
rank of every group holds the same shards): they are flattened into a buffer each step."""

from __future__ import annotations

from typing import Iterable

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from plait.types import ReplicaSync


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a view), else the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class ReplicaGradients:
    """Averages a rank's gradients over the replica groups of the step's quorum; holds plain
    gradients as views of one flat buffer per dtype (built on the first step from the gradients
    the backward made, rebuilt should the set of gradients change)."""

    def __init__(self) -> None:
        self.buffers: dict[torch.dtype, torch.Tensor] = {}  # gradients, then the values' slots
        self.values_at: dict[torch.dtype, int] = {}  # where the values' slots start
        self.attached: list[torch.Tensor] = []  # the gradients that are views of a buffer

    def average(
        self, replicas: ReplicaSync, params: Iterable[torch.nn.Parameter], *values: torch.Tensor
    ) -> None:
        """Average every gradient this rank holds, and ``values`` (e.g. the step's loss), in
        place, in one collective per dtype."""
        held = gradients(params)
        if any(hasattr(grad, "to_local") for _, grad in held):
            average_flattened(replicas, [local_part(grad) for _, grad in held], values)
            return
        if len(held) != len(self.attached) or any(
            grad is not view for (_, grad), view in zip(held, self.attached)
        ):
            self.attach(held, values)
        offsets = dict(self.values_at)
        slots = [self.put(value, offsets) for value in values]
        for buffer in self.buffers.values():
            replicas.average(buffer)
        for value, slot in zip(values, slots):
            value.copy_(slot.view_as(value))

    def put(self, value: torch.Tensor, offsets: dict[torch.dtype, int]) -> torch.Tensor:
        """``value`` copied into its slot of its dtype's buffer (``offsets``: the next free)."""
        start, n = offsets[value.dtype], value.numel()
        slot = self.buffers[value.dtype][start : start + n]
        slot.copy_(value.reshape(-1))
        offsets[value.dtype] = start + n
        return slot

    def attach(
        self, held: list[tuple[torch.nn.Parameter, torch.Tensor]], values: tuple[torch.Tensor, ...]
    ) -> None:
        """Move the gradients ``held`` into fresh buffers (one per dtype, with room for
        ``values`` at the end) and make each parameter's gradient a view of its buffer."""
        sizes: dict[torch.dtype, int] = {}
        for tensor in (*(grad for _, grad in held), *values):
            sizes[tensor.dtype] = sizes.get(tensor.dtype, 0) + tensor.numel()
        device = (held[0][1] if held else values[0]).device
        self.buffers = {
            dtype: torch.empty(n, dtype=dtype, device=device) for dtype, n in sizes.items()
        }
        offsets = dict.fromkeys(sizes, 0)
        self.attached = []
        for param, grad in held:
            start, n = offsets[grad.dtype], grad.numel()
            view = self.buffers[grad.dtype][start : start + n].view_as(grad)
            view.copy_(grad)
            param.grad = view
            self.attached.append(view)
            offsets[grad.dtype] = start + n
        self.values_at = offsets

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        """Zero the gradients for the next step: the buffers in place where gradients are views
        of them, else the optimizer's ``zero_grad`` (to None)."""
        if self.attached:
            for buffer in self.buffers.values():
                buffer.zero_()
        else:
            optimizer.zero_grad(set_to_none=True)


def gradients(
    params: Iterable[torch.nn.Parameter],
) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
    """Each parameter that has a gradient, with it."""
    held = []
    for param in params:
        grad = param.grad
        if grad is not None:
            held.append((param, grad))
    return held


def average_flattened(
    replicas: ReplicaSync, grads: list[torch.Tensor], values: tuple[torch.Tensor, ...]
) -> None:
    """Average ``grads`` and ``values`` through a flat copy per dtype (DTensors' local shards)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in (*values, *grads):
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    for tensors in by_dtype.values():
        flat = replicas.average(_flatten_dense_tensors(tensors))
        for tensor, averaged in zip(tensors, _unflatten_dense_tensors(flat, tensors)):
            tensor.copy_(averaged)


def average_value(replicas: ReplicaSync | None, value: float, device: torch.device) -> float:
    """``value`` (this group's, e.g. its mean loss) averaged over the groups of the step's
    quorum; unchanged when the job runs as one."""
    if replicas is None:
        return value
    return float(replicas.average(torch.tensor([value], dtype=torch.float64, device=device)))
