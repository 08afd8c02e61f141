"""Tokens to their experts and back over the expert-parallel group: two ``all_to_all_single``
calls per layer in forward and two in backward (Megatron-core's ``MoEAlltoAllTokenDispatcher``,
torchtitan's ``ExpertParallel``), which gloo and NCCL both run.

With ``ep`` ranks and ``E`` experts, rank ``r`` holds experts ``[r·E/ep, (r+1)·E/ep)``. A layer's
tokens arrive sorted by expert, ``c[e]`` for expert ``e``, so the ones for rank ``r`` are one
contiguous run::

    counts:    all_to_all(c)            -> c'[s, j]: tokens rank s sends to my local expert j
    dispatch:  all_to_all(tokens, send = [Σ_{e on r} c[e]]_r, receive = [Σ_j c'[s, j]]_s)
               regroup (source, expert) -> (expert, source); my experts run; back to (source,
               expert)
    combine:   all_to_all(outputs, send and receive swapped)

The backward of dispatch is the combine's exchange and vice versa (:class:`AllToAll`). The
collectives are looked up on ``torch.distributed`` at call time, so a test can count them, and
:class:`AllToAllMeter` counts each call, the bytes it sends to other ranks and its wall time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn


@dataclass
class AllToAllMeter:
    """This rank's all-to-all traffic since the last :meth:`reset`: calls, bytes sent to other
    ranks (token rows and counts, forward and backward) and seconds spent in the calls."""

    calls: int = 0
    bytes_sent: int = 0
    seconds: float = 0.0
    on: bool = True  # count (and on a GPU synchronize to time) the calls: logged steps only

    def reset(self) -> None:
        self.calls, self.bytes_sent, self.seconds = 0, 0, 0.0


def all_to_all(
    tensor: torch.Tensor, send: list[int], receive: list[int], group, meter: AllToAllMeter
) -> torch.Tensor:
    """``torch.distributed.all_to_all_single`` of ``tensor``'s rows: ``send[r]`` rows to rank
    ``r`` of ``group``, ``receive[r]`` from it."""
    tensor = tensor.contiguous()
    out = tensor.new_empty((sum(receive), *tensor.shape[1:]))
    if not meter.on:
        dist.all_to_all_single(
            out, tensor, output_split_sizes=receive, input_split_sizes=send, group=group
        )
        return out
    me = dist.get_rank(group)
    row_bytes = tensor[:1].numel() * tensor.element_size()
    if tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)
    start = time.perf_counter()
    dist.all_to_all_single(
        out, tensor, output_split_sizes=receive, input_split_sizes=send, group=group
    )
    if tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)
    meter.seconds += time.perf_counter() - start
    meter.calls += 1
    meter.bytes_sent += (sum(send) - send[me]) * row_bytes
    return out


class AllToAll(torch.autograd.Function):
    """:func:`all_to_all` forward; backward sends the gradients the opposite way."""

    @staticmethod
    def forward(ctx, tensor, send, receive, group, meter):
        ctx.send, ctx.receive, ctx.group, ctx.meter = send, receive, group, meter
        return all_to_all(tensor, send, receive, group, meter)

    @staticmethod
    def backward(ctx, grad):
        return all_to_all(grad, ctx.receive, ctx.send, ctx.group, ctx.meter), None, None, None, None


class AllToAllDispatcher:
    """A mixture-of-experts layer's dispatcher under expert parallelism (the ``dispatcher`` of
    :class:`plait.plugins.models.moe.MoE`): runs the layer's tokens through the experts of
    every rank of ``group``; this rank holds ``experts_per_rank`` of them, from ``first``."""

    def __init__(self, group, ep_size: int, ep_rank: int, n_experts: int, meter: AllToAllMeter):
        self.group, self.ep_size, self.meter = group, ep_size, meter
        self.local = n_experts // ep_size
        self.first = ep_rank * self.local

    def __call__(
        self, tokens: torch.Tensor, counts: torch.Tensor, experts: nn.ModuleDict
    ) -> torch.Tensor:
        ep, local = self.ep_size, self.local
        counts = counts.to(torch.int64)
        received = all_to_all(counts, [local] * ep, [local] * ep, self.group, self.meter)
        by_source = received.view(ep, local).tolist()  # [source][local expert]
        send = counts.view(ep, local).sum(dim=1).tolist()
        receive = [sum(row) for row in by_source]
        arrived = AllToAll.apply(tokens, send, receive, self.group, self.meter)
        chunks = arrived.split([n for row in by_source for n in row])  # (source, expert) order
        outputs = []
        for j in range(local):
            mine = torch.cat([chunks[s * local + j] for s in range(ep)])
            outputs.append(
                experts[str(self.first + j)](mine).split([by_source[s][j] for s in range(ep)])
            )
        back = torch.cat([outputs[j][s] for s in range(ep) for j in range(local)])
        return AllToAll.apply(back, receive, send, self.group, self.meter)
