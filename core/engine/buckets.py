"""The caller's side of the reducer contract for engines without buckets of their own (the
pipeline engine; a parameter-server or local-SGD engine): fuse gradients into flat buckets,
hand each to the reducer, wait, copy the averages back."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from plait.types import GradReducer

DEFAULT_BUCKET_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb


class FlatBucket:
    """Gradients copied into one flat buffer, in the shape of ``torch.distributed.GradBucket``
    (``buffer``, ``gradients``, ``index``, ``is_last``, ``set_buffer``), so torch's comm hooks
    (compression, PowerSGD) run on it as on a DDP bucket."""

    def __init__(self, index: int, grads: list[torch.Tensor], last: bool):
        self._index, self._last, self._grads = index, last, grads
        self._buffer = _flatten_dense_tensors(grads)

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._last

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer

    def gradients(self) -> list[torch.Tensor]:
        return list(_unflatten_dense_tensors(self._buffer, self._grads))

    def copy_back(self, averaged: torch.Tensor) -> None:
        for grad, value in zip(self._grads, _unflatten_dense_tensors(averaged, self._grads)):
            grad.copy_(value)


def fuse(grads: list[torch.Tensor], bucket_bytes: int) -> list[list[torch.Tensor]]:
    """Consecutive gradients of one dtype, up to ``bucket_bytes`` per bucket (at least one)."""
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for grad in grads:
        nbytes = grad.numel() * grad.element_size()
        if not buckets or buckets[-1][-1].dtype != grad.dtype or size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(grad)
        size += nbytes
    return buckets


def average_gradients(params, reducer: GradReducer | None, group: dist.ProcessGroup) -> None:
    """Average the gradients of ``params`` over ``group`` through ``reducer``, bucket by bucket
    (every rank of the group calls this with the same parameters, in the same order); without
    a reducer, with the backend's all-reduce (torch's ``allreduce_hook``)."""
    grads = []
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    grads.sort(key=lambda g: str(g.dtype))  # stable: parameter order within a dtype
    bucket_bytes = reducer.spec.bucket_bytes if reducer is not None else None
    groups = fuse(grads, bucket_bytes or DEFAULT_BUCKET_BYTES)
    buckets = [FlatBucket(i, g, last=i == len(groups) - 1) for i, g in enumerate(groups)]
    futures = [
        reducer.reduce(bucket, group)
        if reducer is not None  # FlatBucket: a GradBucket
        else default_hooks.allreduce_hook(group, bucket)  # type: ignore[arg-type]
        for bucket in buckets
    ]
    for bucket, future in zip(buckets, futures):
        bucket.copy_back(future.wait())
