"""The global gradient norm of a model whose parameters may be tensor-parallel shards and
pipeline stages.

With plain-tensor shards (see :mod:`plait.plugins.tensor_parallel.layers`) a rank's local
``clip_grad_norm_`` is wrong: a split parameter's norm is the sum over the tensor-parallel group
of its shards' squared norms, while a replicated parameter (identical on every rank) counts once;
pipeline stages hold disjoint parameters, so their squares add up over the pipeline group.
Following Megatron (and DeepSpeed, which reads the same ``tensor_model_parallel`` attribute)::

    ||g||^2 = all_reduce_pp( all_reduce_tp( sum_{p split} ||g_p||^2
                                            + [tp_rank == 0] * sum_{p replicated} ||g_p||^2 ) )

Expert parameters under expert parallelism (``allreduce = False``) differ across the ranks of the
expert-parallel group, so their squares are first summed over that group (Megatron's separate
MoE norm)::

    local = dense(tp rule) + all_reduce_ep( experts(tp rule) )
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist


def is_tensor_parallel(p: torch.Tensor) -> bool:
    return bool(getattr(p, "tensor_model_parallel", False))


def is_expert(p: torch.Tensor) -> bool:
    """Held by one expert-parallel rank only (DeepSpeed's mark, ``is_moe_param``)."""
    return getattr(p, "allreduce", True) is False


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float,
                    tp_group=None, tp_rank: int = 0, pp_group=None,
                    ep_group=None) -> torch.Tensor:
    """Clip gradients in place to a global L2 norm of ``max_norm``; return the norm before
    clipping. Without model-parallel groups this is ``torch.nn.utils.clip_grad_norm_``. Every
    rank of the groups must call it (it all-reduces)."""
    params = [p for p in parameters if p.grad is not None]
    if tp_group is None and pp_group is None and ep_group is None:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    device = params[0].grad.device if params else torch.device("cpu")
    squares = torch.zeros((), device=device, dtype=torch.float32)
    experts = torch.zeros((), device=device, dtype=torch.float32)
    for p in params:
        if is_tensor_parallel(p) or tp_rank == 0:
            target = experts if ep_group is not None and is_expert(p) else squares
            target += p.grad.detach().float().pow(2).sum()
    if ep_group is not None:
        dist.all_reduce(experts, group=ep_group)
        squares += experts
    for group in (tp_group, pp_group):
        if group is not None:
            dist.all_reduce(squares, group=group)
    total_norm = squares.sqrt()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total_norm)
    return total_norm
