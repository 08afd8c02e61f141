"""Expert parameters: how they are marked, and how engines average their gradients.

Under ``parallel.ep > 1`` a rank holds only its share of each layer's experts, so an expert's
gradient is averaged over the ranks that hold the same expert (the expert-data-parallel group,
``dp / ep`` ranks), not over all of dp. Each of them already summed, through the all-to-all's
backward, the gradients from the tokens of its ``ep`` peers; the global batch's mean over ``dp``
ranks is therefore (Megatron's and DeepSpeed's expert scaling)::

    g_expert = (1 / dp) · Σ_{edp group} g_local          g_dense = (1 / dp) · Σ_{dp group} g_local

Expert parameters carry DeepSpeed's marks (``allreduce = False``, ``group_name = "ep_size_<ep>"``,
read by ``deepspeed.moe.utils.is_moe_param`` and its optimizer-group split), so the DDP, FSDP and
pipeline engines and DeepSpeed's ZeRO all recognise them the same way. FSDP reduces expert
gradients itself, over its expert shard group, but sums them there: the engine divides them by
``dp`` after (:func:`divide_expert_gradients`).
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


def is_expert(p: torch.Tensor) -> bool:
    """Held by one expert-parallel rank only (DeepSpeed's mark, ``is_moe_param``)."""
    return getattr(p, "allreduce", True) is False


def mark_expert(p: torch.nn.Parameter, ep: int) -> None:
    setattr(p, "allreduce", False)  # DeepSpeed's marks: attributes torch does not declare
    setattr(p, "group_name", f"ep_size_{ep}")


def expert_names(model: torch.nn.Module) -> list[str]:
    return [name for name, p in model.named_parameters() if is_expert(p)]


def average_expert_gradients(params: Iterable[torch.Tensor], edp_group, dp_size: int) -> None:
    """``g = Σ_edp g / dp`` for the expert parameters among ``params``, one flat all-reduce per
    dtype (every rank of the group calls this with the same parameters in the same order); where
    the group is this rank alone (``ep == dp``), one foreach division in place, no copy."""
    grads = []
    for p in params:
        if not is_expert(p):
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    if dist.get_world_size(edp_group) == 1:
        if grads:
            torch._foreach_div_(grads, dp_size)
        return
    for dtype in sorted({g.dtype for g in grads}, key=str):
        same = [g for g in grads if g.dtype == dtype]
        flat = _flatten_dense_tensors(same)
        dist.all_reduce(flat, group=edp_group)
        flat.div_(dp_size)
        for grad, value in zip(same, _unflatten_dense_tensors(flat, same)):
            grad.copy_(value)


def divide_expert_gradients(params: Iterable[torch.Tensor], dp_size: int) -> None:
    """``g /= dp`` for the expert parameters among ``params`` whose gradients were summed, not
    averaged, over their expert-data-parallel ranks (this rank's local parts)."""
    for p in params:
        if p.grad is not None and is_expert(p):
            grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            grad.div_(dp_size)
