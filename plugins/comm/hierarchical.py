"""``comm=hierarchical``: Horovod's hierarchical all-reduce.

For ``n`` nodes of ``L`` ranks each and a buffer of ``S`` bytes::

    1. reduce-scatter inside the node      rank with local index l holds the node's sum of shard l
    2. all-reduce shard l across nodes     among the ranks with the same local index l, around
                                           the ring of ``ring.py``
    3. all-gather inside the node          every rank holds the full sum

Only step 2 crosses the slow link: each rank sends its ``1/L`` shard, so the link carries
``2 (n-1) S`` bytes in ``2 (n-1)`` steps, against ``2 n S (nL-1)/(nL)`` bytes in ``2 (nL-1)``
steps for a ring over all ranks: a ratio of ``(n-1) L / (nL-1)`` (2/3 on 2 nodes of 2).
(Horovod: ``HOROVOD_HIERARCHICAL_ALLREDUCE``, ``NCCLHierarchicalAllreduce`` in
``horovod/common/ops/nccl_operations.cc``: NCCL reduce-scatter, MPI all-reduce across nodes,
NCCL all-gather.) Steps 1 and 3 are the backend's own reduce-scatter and all-gather over the
topology's intra-node group; step 2 is plait's ring over the inter-node group
(``Topology.node_groups``), bandwidth-optimal and written out, so the slow link carries exactly
the ``2 (n-1)`` sends per rank counted above (gloo's own all-reduce adds messages of its own
protocol). A buffer ``L`` does not divide is padded with zeros, as Horovod pads its fusion buffer.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from plait.plugins.comm.algorithm import AlgorithmGroup
from plait.plugins.comm.ring import ring_all_reduce_


class HierarchicalGroup(AlgorithmGroup):
    name = "hierarchical"

    def __init__(self, group: dist.ProcessGroup, intra: dist.ProcessGroup,
                 inter: dist.ProcessGroup):
        super().__init__(group)
        self.intra, self.inter = intra, inter

    def all_reduce_(self, tensor: torch.Tensor) -> None:
        hierarchical_all_reduce_(tensor, self.intra, self.inter)


def hierarchical_all_reduce_(tensor: torch.Tensor, intra: dist.ProcessGroup,
                             inter: dist.ProcessGroup) -> None:
    """Sum ``tensor`` (1-D, contiguous) over ``intra`` x ``inter`` in place."""
    local_size, numel = intra.size(), tensor.numel()
    padded = tensor
    if numel % local_size:
        padded = torch.zeros(numel + local_size - numel % local_size, dtype=tensor.dtype,
                             device=tensor.device)
        padded[:numel] = tensor
    shard = torch.empty(padded.numel() // local_size, dtype=tensor.dtype, device=tensor.device)
    dist.reduce_scatter_single(shard, padded, group=intra)
    ring_all_reduce_(shard, inter)
    dist.all_gather_single(padded, shard, group=intra)
    if padded is not tensor:
        tensor.copy_(padded[:numel])
