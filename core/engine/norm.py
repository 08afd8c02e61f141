"""The global gradient norm, over whichever process groups hold different parts of the
gradients, and clipping by it. Implemented once, for every engine.

A rank's local ``clip_grad_norm_`` is wrong as soon as its gradients are shards:

- FSDP's dp shards (``shard``): each rank holds a disjoint part of every parameter, so the
  squares add up over the shard group (HSDP's replicas hold the same parts: not summed);
- tensor-parallel shards (``tp``, see :mod:`plait.engine.tensor_shards`): a split parameter's
  squares add up over the tp group, while a replicated parameter (the same on every tp rank)
  counts once, on tp rank 0;
- pipeline stages (``pp``) hold disjoint parameters: their squares add up over the stages;
- experts under expert parallelism (``ep``, marked by :func:`plait.engine.experts.is_expert`)
  differ across the expert-parallel group: their squares are summed over it first (and, FSDP-
  sharded, over their own shard group, ``expert_shard``) — Megatron's separate MoE norm.

Context-parallel ranks hold the same parameters (their gradients are averaged over ``dp x cp``),
so ``cp`` adds nothing unless FSDP shards over it, which its shard group then covers. Following
Megatron (and DeepSpeed, which reads the same ``tensor_model_parallel`` attribute)::

    dense   = Σ_shard Σ_local [split or tp_rank == 0] ||g||²
    experts = Σ_ep Σ_expert_shard Σ_local [split or tp_rank == 0] ||g||²
    ||g||²  = Σ_pp Σ_tp (dense + experts)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

import torch
import torch.distributed as dist

from plait.engine.experts import is_expert


def is_tensor_parallel(p: torch.Tensor) -> bool:
    """A tensor-parallel shard (Megatron's mark, set by the tensor-parallel layers)."""
    return bool(getattr(p, "tensor_model_parallel", False))


@dataclass(frozen=True)
class ShardGroups:
    """The process groups over which a rank's gradients are parts of a larger whole; None for an
    axis that splits nothing here. ``tp_rank``: this rank's, which counts replicated
    parameters."""

    shard: dist.ProcessGroup | None = None
    expert_shard: dist.ProcessGroup | None = None
    tp: dist.ProcessGroup | None = None
    tp_rank: int = 0
    pp: dist.ProcessGroup | None = None
    ep: dist.ProcessGroup | None = None

    @classmethod
    def of(
        cls,
        topology,
        shard: dist.ProcessGroup | None = None,
        expert_shard: dist.ProcessGroup | None = None,
    ) -> ShardGroups:
        """The model-parallel axes of ``topology`` that are in use (tp, pp, ep), with the
        data-parallel shard groups of an engine that shards over dp (FSDP's)."""
        dims = topology.dims
        return cls(
            shard=shard,
            expert_shard=expert_shard,
            tp=topology.group("tp") if dims.tp > 1 else None,
            tp_rank=topology.tp_rank,
            pp=topology.group("pp") if dims.pp > 1 else None,
            ep=topology.group("ep") if dims.ep > 1 else None,
        )

    @property
    def none(self) -> bool:
        """Every gradient is whole on this rank: the norm is a local one."""
        return self.shard is None and self.tp is None and self.pp is None and self.ep is None


def local_part(grad: torch.Tensor) -> torch.Tensor:
    """This rank's part of a gradient: a DTensor's local shard (FSDP), else the tensor."""
    return grad.to_local() if hasattr(grad, "to_local") else grad.detach()


def grad_norm(params: list[torch.Tensor], groups: ShardGroups) -> torch.Tensor:
    """``||g||`` over every part of every parameter (the module docstring's sum): a collective
    on every rank of ``groups``."""
    dense: list[torch.Tensor] = []
    experts_local: list[torch.Tensor] = []
    for p in params:
        if p.grad is not None and (is_tensor_parallel(p) or groups.tp_rank == 0):
            expert = groups.ep is not None and is_expert(p)
            (experts_local if expert else dense).append(local_part(p.grad))
    device = next((p.grad.device for p in params if p.grad is not None), torch.device("cpu"))
    squares = sum_of_squares(dense, device)
    experts = sum_of_squares(experts_local, device)
    if groups.shard is not None:
        dist.all_reduce(squares, group=groups.shard)
    if groups.ep is not None:
        if groups.expert_shard is not None:
            dist.all_reduce(experts, group=groups.expert_shard)
        dist.all_reduce(experts, group=groups.ep)
        squares += experts
    for group in (groups.tp, groups.pp):
        if group is not None:
            dist.all_reduce(squares, group=group)
    return squares.sqrt()


def sum_of_squares(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """``Σ ||t||²`` in fp32 on ``device``, by torch's grouped norm (``get_total_norm``: one
    foreach kernel per device and dtype, as ``clip_grad_norm_`` computes it), not a kernel or
    three per tensor: on a GPU a GPT's ~150 parameters' launches were a tenth of a step."""
    if not tensors:
        return torch.zeros((), device=device, dtype=torch.float32)
    return torch.nn.utils.get_total_norm(tensors, 2.0).to(device, torch.float32).square()


def clip_grads_(params: list[torch.Tensor], max_norm: float, norm: torch.Tensor) -> None:
    """Scale every gradient by ``min(1, max_norm / (norm + 1e-6))``, torch's
    ``clip_grads_with_norm_`` rule, on each rank's local parts (one foreach multiply per
    device); nothing for an infinite ``max_norm`` (clipping off)."""
    if math.isinf(max_norm):
        return
    coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for grad in (p.grad for p in params if p.grad is not None):
        part = local_part(grad)
        by_device.setdefault(part.device, []).append(part)
    for device, parts in by_device.items():
        torch._foreach_mul_(parts, coefficient.to(device))


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor], max_norm: float, groups: ShardGroups = ShardGroups()
) -> torch.Tensor:
    """Clip gradients in place to a global L2 norm of ``max_norm`` (``math.inf``: measure only);
    return the norm before clipping. With every gradient whole on this rank this is
    ``torch.nn.utils.clip_grad_norm_``. Every rank of ``groups`` must call it."""
    params = [p for p in parameters if p.grad is not None]
    if groups.none:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    norm = grad_norm(params, groups)
    clip_grads_(params, max_norm, norm)
    return norm
