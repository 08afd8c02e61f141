"""An engine's side of replica groups that run as independent torch jobs (``fault=torchft``):
after the strategy's own reduction inside its group, each rank's gradients are averaged with the
same rank of every other group in the step's quorum, in one flat buffer
(:class:`plait.types.ReplicaSync` sums it); the step's loss travels in the same buffer, so a step
costs one collective across the groups, not two.

Each step the backward makes fresh gradients (``zero_grad`` sets them to None, as a plain loop's
does), and one pass writes each of them, divided by the quorum's size, into its slot of the
buffer; the buffer is summed over the groups in place and the parameters take its slots as their
gradients. So a step reads each gradient once, with no zeroing, no accumulation into last
step's gradient and no division after the collective (each a pass over every gradient, ~1% of a
CPU step each); the buffer, allocated once, is what DDP's buckets cost. With FSDP a rank's
gradients are its shards (DTensors' local parts, the same rank of every group holds the same
shards): they are flattened into a buffer each step."""

from __future__ import annotations

from typing import Iterable

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from plait.types import ReplicaSync


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a view), else the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class ReplicaGradients:
    """Averages a rank's gradients over the replica groups of the step's quorum through one flat
    buffer per dtype (laid out on the first step from the gradients the backward made, again
    should their shapes change), whose slots are the parameters' gradients until the next
    ``zero_grad(set_to_none=True)``."""

    def __init__(self) -> None:
        self.buffers: dict[torch.dtype, torch.Tensor] = {}  # gradients, then the values' slots
        self.values_at: dict[torch.dtype, int] = {}  # where the values' slots start
        self.layout: list[tuple[torch.Size, torch.dtype]] = []  # the gradients' shapes
        self.slots: list[torch.Tensor] = []  # each gradient's view of its buffer

    def average(
        self, replicas: ReplicaSync, params: Iterable[torch.nn.Parameter], *values: torch.Tensor
    ) -> None:
        """Average every gradient this rank holds, and ``values`` (e.g. the step's loss), in
        one collective per dtype; the parameters' gradients are then views of the buffers."""
        held = gradients(params)
        if any(hasattr(grad, "to_local") for _, grad in held):
            average_flattened(replicas, [local_part(grad) for _, grad in held], values)
            return
        layout = [(grad.shape, grad.dtype) for _, grad in held]
        if layout != self.layout:
            self.lay_out(layout, values, (held[0][1] if held else values[0]).device)
        participants = replicas.participants()
        for (param, grad), slot in zip(held, self.slots):
            torch.div(grad, participants, out=slot)
            param.grad = slot
        offsets = dict(self.values_at)
        slots = [self.put(value / participants, offsets) for value in values]
        for buffer in self.buffers.values():
            replicas.sum(buffer)
        for value, slot in zip(values, slots):
            value.copy_(slot.view_as(value))

    def put(self, value: torch.Tensor, offsets: dict[torch.dtype, int]) -> torch.Tensor:
        """``value`` copied into its slot of its dtype's buffer (``offsets``: the next free)."""
        start, n = offsets[value.dtype], value.numel()
        slot = self.buffers[value.dtype][start : start + n]
        slot.copy_(value.reshape(-1))
        offsets[value.dtype] = start + n
        return slot

    def lay_out(
        self,
        layout: list[tuple[torch.Size, torch.dtype]],
        values: tuple[torch.Tensor, ...],
        device: torch.device,
    ) -> None:
        """Fresh buffers (one per dtype, with room for ``values`` at the end) and each
        gradient's slot in them, in the order of ``layout``."""
        sizes: dict[torch.dtype, int] = {}
        numels = [(shape.numel(), dtype) for shape, dtype in layout]
        for n, dtype in (*numels, *((value.numel(), value.dtype) for value in values)):
            sizes[dtype] = sizes.get(dtype, 0) + n
        self.buffers = {
            dtype: torch.empty(n, dtype=dtype, device=device) for dtype, n in sizes.items()
        }
        offsets = dict.fromkeys(sizes, 0)
        self.slots = []
        for shape, dtype in layout:
            start, n = offsets[dtype], shape.numel()
            self.slots.append(self.buffers[dtype][start : start + n].view(shape))
            offsets[dtype] = start + n
        self.layout, self.values_at = layout, offsets


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
