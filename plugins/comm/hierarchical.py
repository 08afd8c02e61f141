"""``comm=hierarchical``: Horovod's hierarchical all-reduce.

For ``n`` nodes of ``L`` ranks each and a buffer of ``S`` bytes cut into ``L`` chunks::

    1. reduce-scatter inside the node      the rank at local position l holds the node's sum of
                                           chunk l+1 (mod L)
    2. all-reduce that chunk across nodes  among the ranks at the same local position, which
                                           hold the same chunk
    3. all-gather inside the node          every rank holds the full sum

Only step 2 crosses the slow link: each rank sends its ``1/L`` share, so the link carries
``2 (n-1) S`` bytes in ``2 (n-1)`` steps, against ``2 n S (nL-1)/(nL)`` bytes in ``2 (nL-1)``
steps for a ring over all ranks: a ratio of ``(n-1) L / (nL-1)`` (2/3 on 2 nodes of 2).
(Horovod: ``HOROVOD_HIERARCHICAL_ALLREDUCE``, ``NCCLHierarchicalAllreduce`` in
``horovod/common/ops/nccl_operations.cc``: NCCL reduce-scatter, MPI all-reduce across nodes,
NCCL all-gather.) Here all three steps are the ring of ``ring.py``: its reduce-scatter and
all-gather halves over the topology's intra-node group, a whole ring all-reduce over the
inter-node group (``Topology.node_groups``). So the slow link carries exactly the ``2 (n-1)``
sends per rank counted above (gloo's own all-reduce adds messages of its own protocol), and the
intra-node steps avoid gloo's CPU reduce-scatter and all-gather, measured several times slower
per byte than its point-to-point sends. Chunks of a buffer ``L`` does not divide differ by one
element, as in the ring; nothing is padded.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from plait.plugins.comm.algorithm import AlgorithmGroup
from plait.plugins.comm.ring import (
    owned_chunk,
    ring_all_gather_,
    ring_all_reduce_,
    ring_reduce_scatter_,
)


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
    chunks = tensor.tensor_split(intra.size())
    ring_reduce_scatter_(chunks, intra)
    ring_all_reduce_(chunks[owned_chunk(intra)], inter)
    ring_all_gather_(chunks, intra)
