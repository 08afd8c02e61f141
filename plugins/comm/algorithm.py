"""An explicit all-reduce algorithm dressed as a torch ``ProcessGroup``.

torch's comm hooks (``allreduce_hook``, ``fp16_compress_hook``, ``bf16_compress_hook``,
``powerSGD_hook``) call ``dist.all_reduce(tensor, group=state)`` on whatever process group they
are given. Handing them an :class:`AlgorithmGroup` instead of the real group makes every one of
them run plait's algorithm: the compression is torch's, the algorithm is plait's, and each
composes with each without a line of either being rewritten (Horovod keeps its algorithms behind
one interface in ``common/ops/`` the same way).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future


class AlgorithmGroup(dist.ProcessGroup):
    """A process group whose ``allreduce`` (sum) runs :meth:`all_reduce_` over ``group``;
    every other collective is the real group's business and is not offered here.

    The algorithm runs synchronously in the caller's thread; the returned work is complete.
    """

    name = "algorithm"

    def __init__(self, group: dist.ProcessGroup):
        super().__init__(group.rank(), group.size())
        self.group = group

    def all_reduce_(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over the group, in place."""
        raise NotImplementedError

    def allreduce(self, tensors, opts=None):
        if opts is not None and opts.reduceOp != dist.ReduceOp.SUM:
            raise ValueError(f"comm={self.name} implements the sum all-reduce only")
        for tensor in tensors:
            self.all_reduce_(tensor)
        future = torch.futures.Future()
        future.set_result(tensors)
        return _create_work_from_future(future)

    def getBackendName(self) -> str:
        return f"plait-{self.name}"
