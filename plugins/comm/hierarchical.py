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

Done one after the other, the three steps leave the slow link idle during both intra-node steps
and the intra-node CPU idle while the link sends. A buffer longer than one segment
(``SEGMENT_BYTES``) is therefore pipelined, as NCCL pipelines its rings over chunks: segment
``i`` crosses the nodes while segment ``i+1`` is reduced inside the node and segment ``i-1``
gathered, each step in its own thread (message tags keep the two intra-node threads apart on
their shared group). Bytes and steps on the link are the same as unpipelined.
"""

from __future__ import annotations

import queue
import threading

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

    def __init__(
        self, group: dist.ProcessGroup, intra: dist.ProcessGroup, inter: dist.ProcessGroup
    ):
        super().__init__(group)
        self.intra, self.inter = intra, inter

    def all_reduce_(self, tensor: torch.Tensor) -> None:
        hierarchical_all_reduce_(tensor, self.intra, self.inter)


SEGMENT_BYTES = 4 * 2**20
_GATHER_TAG = 1  # the intra-node all-gather's messages; the reduce-scatter's use tag 0


def hierarchical_all_reduce_(
    tensor: torch.Tensor,
    intra: dist.ProcessGroup,
    inter: dist.ProcessGroup,
    segment_bytes: int = SEGMENT_BYTES,
) -> None:
    """Sum ``tensor`` (1-D, contiguous) over ``intra`` x ``inter`` in place, pipelined over
    segments of ``segment_bytes``."""
    segments = [
        s.tensor_split(intra.size())
        for s in tensor.split(max(1, segment_bytes // tensor.element_size()))
    ]
    if len(segments) <= 1:
        for chunks in segments:
            ring_reduce_scatter_(chunks, intra)
            ring_all_reduce_(chunks[owned_chunk(intra)], inter)
            ring_all_gather_(chunks, intra)
        return
    reduced, summed = queue.Queue(), queue.Queue()
    errors: list[BaseException] = []

    def stage(step, inbox: queue.Queue, outbox: queue.Queue | None) -> None:
        """Run ``step`` on each segment from ``inbox`` in order; ``None`` ends the stage."""
        try:
            while (chunks := inbox.get()) is not None:
                step(chunks)
                if outbox is not None:
                    outbox.put(chunks)
        except BaseException as error:  # re-raised in the caller's thread below
            errors.append(error)
        finally:
            if outbox is not None:
                outbox.put(None)

    threads = [
        threading.Thread(
            target=stage,
            args=(lambda c: ring_all_reduce_(c[owned_chunk(intra)], inter), reduced, summed),
        ),
        threading.Thread(
            target=stage, args=(lambda c: ring_all_gather_(c, intra, _GATHER_TAG), summed, None)
        ),
    ]
    for thread in threads:
        thread.start()
    try:
        for chunks in segments:
            if errors:
                break
            ring_reduce_scatter_(chunks, intra)
            reduced.put(chunks)
    finally:
        reduced.put(None)
        for thread in threads:
            thread.join()
    if errors:
        raise errors[0]
