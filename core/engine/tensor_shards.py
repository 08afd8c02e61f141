"""Tensor-parallel shards of a full tensor, and the full tensor again from every rank's shard.

A split parameter carries its placement as Megatron's attributes (set by the tensor-parallel
layers): ``partition_dim`` (the dim it is split along) and ``partition_stride`` (``parts``: the
blocks along that dim each cut into ``size`` shards, e.g. 3 for a fused ``[q; k; v]`` weight,
so every rank holds whole heads of each). Checkpoints, exports and Hugging Face copies use these
to go between a rank's shard and the unsplit tensor::

    full = [B_1 | ... | B_parts] along dim;   shard_r = [B_1[r] | ... | B_parts[r]]
"""

from __future__ import annotations

import torch


def split_tensor(full: torch.Tensor, dim: int, parts: int, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s shard: each of the ``parts`` blocks along ``dim`` cut into ``size``."""
    blocks = full.unflatten(dim, (parts, -1))
    return blocks.chunk(size, dim=dim + 1)[rank].flatten(dim, dim + 1).clone()


def merge_tensors(shards: list[torch.Tensor], dim: int, parts: int) -> torch.Tensor:
    """The inverse of :func:`split_tensor` over all ranks' shards."""
    blocks = [s.unflatten(dim, (parts, -1)) for s in shards]
    return torch.cat(blocks, dim=dim + 1).flatten(dim, dim + 1)
