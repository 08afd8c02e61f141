"""Ulysses (DeepSpeed's ``DistributedAttention``): an all-to-all turns ``q, k, v`` from
sequence-sharded to head-sharded, each rank attends over the whole sequence with ``H/C`` of the
heads, and a second all-to-all turns the output back::

    [b, H, T/C, d]  --all-to-all-->  [b, H/C, T, d]  --attention-->  [b, H/C, T, d]
                    --all-to-all-->  [b, H, T/C, d]

Rank ``r`` holds tokens ``r·T/C .. (r+1)·T/C - 1`` (the contiguous layout), so gathering the
ranks' parts in rank order gives the sequence in order. The attention is the model's own module
(causal, and with packed documents the model's document mask), unchanged. The backward of an
all-to-all is the opposite all-to-all. Each rank sends ``(C-1)/C`` of every tensor it exchanges:
per layer ``4·(C-1)/C·(T/C)·h·v`` bytes forward (q, k, v and the output), the same backward. It
needs the heads (``H``, or ``H/tp`` under tensor parallelism) divisible by ``C``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from plait.plugins.context_parallel.ring import ExchangeStats


def all_to_all(
    x: torch.Tensor,
    group: dist.ProcessGroup,
    scatter_dim: int,
    gather_dim: int,
    stats: ExchangeStats,
) -> torch.Tensor:
    """Cut ``x`` into ``C`` parts along ``scatter_dim``, send part ``j`` to rank ``j``, and join
    the parts received along ``gather_dim`` in rank order."""
    size = dist.get_world_size(group)
    parts = [part.contiguous() for part in x.chunk(size, dim=scatter_dim)]
    received = [torch.empty_like(parts[0]) for _ in range(size)]
    dist.all_to_all(received, parts, group=group)
    stats.exchanges += 1
    stats.bytes_sent += (size - 1) * parts[0].numel() * parts[0].element_size()
    return torch.cat(received, dim=gather_dim)


class AllToAll(torch.autograd.Function):
    """:func:`all_to_all` whose backward is the opposite all-to-all."""

    @staticmethod
    def forward(ctx, x, group, scatter_dim: int, gather_dim: int, stats: ExchangeStats):
        ctx.group, ctx.dims, ctx.stats = group, (scatter_dim, gather_dim), stats
        return all_to_all(x, group, scatter_dim, gather_dim, stats)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        grad = all_to_all(grad, ctx.group, gather_dim, scatter_dim, ctx.stats)
        return grad, None, None, None, None


HEADS, SEQ = 1, 2  # dims of [b, heads, seq, d]


def ulysses_attention(
    attention,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    documents: torch.Tensor | None,
    group: dist.ProcessGroup,
    stats: ExchangeStats,
) -> torch.Tensor:
    """``attention(q, k, v, documents)`` over the whole sequence, with ``H/C`` heads per rank."""
    q, k, v = (AllToAll.apply(t, group, HEADS, SEQ, stats) for t in (q, k, v))
    return AllToAll.apply(attention(q, k, v, documents), group, SEQ, HEADS, stats)
