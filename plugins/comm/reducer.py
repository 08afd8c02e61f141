"""The reducer comm plugins return: a compression (torch's comm hook) over an algorithm (a
process group), behind the ``GradReducer`` contract of ``plait.types``.

    algorithm       process group the hook all-reduces over
    allreduce/flat  the real group: the backend's own all-reduce (gloo, NCCL)
    ring            RingGroup(group)                       ring.py
    hierarchical    HierarchicalGroup(group, intra, inter) hierarchical.py

    compression     torch hook (ddp_comm_hooks)
    none            default_hooks.allreduce_hook
    fp16, bf16      default_hooks.fp16_compress_hook / bf16_compress_hook    cast.py
    powersgd        powerSGD_hook.powerSGD_hook with PowerSGDState           powersgd.py

The explicit algorithms run on one background thread, one bucket after another in the order
they were handed over (Horovod's background loop), so DDP's backward keeps computing the next
bucket's gradients while one is reduced; the backend's own all-reduce is asynchronous already.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from plait.plugins.comm.cast import cast_hook
from plait.plugins.comm.powersgd import powersgd_hook
from plait.types import CommSpec, GradBucket

Hook = tuple[Callable, object]  # (hook, state) as DistributedDataParallel.register_comm_hook takes


class Reducer:
    """Averages gradient buckets over a group: ``compress(algorithm(group))``.

    :param algorithm: maps a process group to the group the hook all-reduces over (the group
        itself for the backend's all-reduce); None when the hook may run in the caller's thread.
    :param compress: maps that group to ``(hook, state)``.
    """

    def __init__(
        self,
        spec: CommSpec,
        compress: Callable[[dist.ProcessGroup], Hook],
        algorithm: Callable[[dist.ProcessGroup], dist.ProcessGroup] | None = None,
    ):
        self.spec = spec
        self._compress, self._algorithm = compress, algorithm
        self._hooks: dict[dist.ProcessGroup, Hook] = {}
        self._thread = ThreadPoolExecutor(1, "plait-comm") if algorithm is not None else None

    def reduce(
        self, bucket: GradBucket, group: dist.ProcessGroup
    ) -> torch.futures.Future[torch.Tensor]:
        if group not in self._hooks:
            self._hooks[group] = self._compress(
                self._algorithm(group) if self._algorithm else group
            )
        hook, state = self._hooks[group]
        if self._thread is None:
            return hook(state, bucket)
        result: torch.futures.Future[torch.Tensor] = torch.futures.Future()

        def run() -> None:
            try:
                result.set_result(hook(state, bucket).wait())
            except BaseException as error:  # reaches the waiting engine, not a dead thread
                result.set_exception(error)

        self._thread.submit(run)
        return result


def compression_of(
    spec: CommSpec, powersgd_rank: int, powersgd_start_iter: int, seed: int
) -> Callable[[dist.ProcessGroup], Hook]:
    """``group -> (hook, state)`` for ``spec.compression``."""
    if spec.compression == "none":
        return lambda group: (default_hooks.allreduce_hook, group)
    if spec.compression == "powersgd":
        return lambda group: powersgd_hook(group, powersgd_rank, powersgd_start_iter, seed)
    return lambda group: cast_hook(spec.compression, group)
