"""Communication across the tensor-parallel group as autograd functions (Megatron-core's
``tensor_parallel/mappings.py``), named by what each does to a *region* of the network.

Every function takes the process group explicitly (no module-level state). Activations are
``[batch, seq, hidden]`` in plait, so the sequence-parallel functions split and join along
``SEQUENCE_DIM = 1`` (Megatron keeps ``[seq, batch, hidden]`` and uses dim 0).

==========================================  =====================  =====================
function                                    forward                backward
==========================================  =====================  =====================
``copy_to_tensor_model_parallel_region``    identity               all-reduce
``reduce_from_tensor_model_parallel_region`` all-reduce            identity
``scatter_to_tensor_model_parallel_region`` keep own last-dim part all-gather (last dim)
``gather_from_tensor_model_parallel_region`` all-gather (last dim) keep own last-dim part
``scatter_to_sequence_parallel_region``     keep own seq chunk     all-gather (seq)
``gather_from_sequence_parallel_region``    all-gather (seq)       reduce-scatter (seq)
``reduce_scatter_to_sequence_parallel_region`` reduce-scatter (seq) all-gather (seq)
==========================================  =====================  =====================

The collectives are looked up on ``torch.distributed`` at call time, so a test can count them by
wrapping ``torch.distributed.all_reduce`` / ``all_gather`` / ``reduce_scatter``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

SEQUENCE_DIM = 1


def _all_reduce(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    x = x.contiguous().clone()
    dist.all_reduce(x, group=group)
    return x


def _all_gather(x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=dim)


def _reduce_scatter(x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    chunks = [c.contiguous() for c in x.chunk(dist.get_world_size(group), dim=dim)]
    out = torch.empty_like(chunks[0])
    dist.reduce_scatter(out, chunks, group=group)
    return out


def _split(x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    size = dist.get_world_size(group)
    return x.chunk(size, dim=dim)[dist.get_rank(group)].contiguous()


class _CopyToModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, group, -1)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.group, -1), None


class _GatherFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather(x, group, -1)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, ctx.group, -1), None


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, group, SEQUENCE_DIM)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.group, SEQUENCE_DIM), None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather(x, group, SEQUENCE_DIM)

    @staticmethod
    def backward(ctx, grad):
        # The consumer is column-parallel: each rank holds a partial gradient of the whole
        # sequence, so sum them and keep this rank's chunk.
        return _reduce_scatter(grad, ctx.group, SEQUENCE_DIM), None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, group, SEQUENCE_DIM)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.group, SEQUENCE_DIM), None


def copy_to_tensor_model_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Enter a column-parallel region: ``f`` in the Megatron paper (identity / all-reduce)."""
    return _CopyToModelParallelRegion.apply(x, group)


def reduce_from_tensor_model_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Leave a row-parallel region: ``g`` in the Megatron paper (all-reduce / identity)."""
    return _ReduceFromModelParallelRegion.apply(x, group)


def scatter_to_tensor_model_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """A whole activation → this rank's slice of its last dimension, before a row-parallel
    linear whose input is not split yet."""
    return _ScatterToModelParallelRegion.apply(x, group)


def gather_from_tensor_model_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Each rank's slice of the last dimension → the whole activation on every rank, after a
    column-parallel linear whose output is used whole."""
    return _GatherFromModelParallelRegion.apply(x, group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Enter the sequence-parallel region: keep this rank's ``seq / tp`` chunk."""
    return _ScatterToSequenceParallelRegion.apply(x, group)


def gather_from_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Sequence-split → whole sequence before a column-parallel linear (``g`` under SP)."""
    return _GatherFromSequenceParallelRegion.apply(x, group)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Partial sums of the whole sequence → summed, sequence-split (``g-bar`` under SP)."""
    return _ReduceScatterToSequenceParallelRegion.apply(x, group)
