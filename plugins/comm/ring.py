"""``comm=ring``: the ring all-reduce, written out with point-to-point sends.

With ``p`` ranks in a ring and the buffer cut into ``p`` chunks ``c_0 .. c_{p-1}``, rank ``r``
sends to ``r+1`` and receives from ``r-1``::

    reduce-scatter, step s = 0 .. p-2:  send c_{r-s},   receive c_{r-s-1} and add it
                                        (afterwards rank r holds the full sum of c_{r+1})
    all-gather,     step s = 0 .. p-2:  send c_{r+1-s}, receive c_{r-s} and keep it

(indices mod p). Each rank sends ``2 (p-1)/p`` of the buffer in ``2 (p-1)`` steps, the bandwidth
optimum (Patarasuk & Yuan 2009), but every step crosses every link of the ring, the slow ones
between nodes included: over ``n`` nodes of ``L`` ranks, ``2 (nL-1)`` steps on the slow link and
``2 n S (nL-1)/(nL)`` bytes across node boundaries for a buffer of ``S`` bytes.

Sums are exact on integers, so the result equals torch's all-reduce bit for bit there; on floats
it differs only by the order of the additions. The two halves are also the intra-node steps of
``hierarchical.py``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from plait.plugins.comm.algorithm import AlgorithmGroup


class RingGroup(AlgorithmGroup):
    name = "ring"

    def all_reduce_(self, tensor: torch.Tensor) -> None:
        ring_all_reduce_(tensor, self.group)


def ring_all_reduce_(tensor: torch.Tensor, group: dist.ProcessGroup) -> None:
    """Sum ``tensor`` (1-D, contiguous) over ``group`` in place, around the ring of its ranks."""
    chunks = tensor.tensor_split(group.size())
    ring_reduce_scatter_(chunks, group)
    ring_all_gather_(chunks, group)


def owned_chunk(group: dist.ProcessGroup) -> int:
    """The chunk this rank holds fully reduced after :func:`ring_reduce_scatter_`."""
    return (group.rank() + 1) % group.size()


def ring_reduce_scatter_(
    chunks: tuple[torch.Tensor, ...], group: dist.ProcessGroup, tag: int = 0
) -> None:
    """Sum ``chunks`` (one per rank of ``group``, views of one buffer) around the ring, so that
    this rank ends with the full sum of chunk :func:`owned_chunk`; the others hold partial sums.
    ``tag`` keeps the messages apart from another thread's on the same group."""
    p, r = group.size(), group.rank()
    for s in range(p - 1):
        send, receive = (r - s) % p, (r - s - 1) % p
        chunks[receive].add_(_pass_along(chunks, send, receive, group, tag))


def ring_all_gather_(
    chunks: tuple[torch.Tensor, ...], group: dist.ProcessGroup, tag: int = 0
) -> None:
    """Give every rank every rank's :func:`owned_chunk`, around the ring."""
    p, r = group.size(), group.rank()
    for s in range(p - 1):
        send, receive = (r + 1 - s) % p, (r - s) % p
        chunks[receive].copy_(_pass_along(chunks, send, receive, group, tag))


def _pass_along(
    chunks, send: int, receive: int, group: dist.ProcessGroup, tag: int
) -> torch.Tensor:
    """Send one chunk to the right neighbour, receive one from the left (a chunk of a buffer
    shorter than the ring is empty, and then is neither sent nor received)."""
    p, r = group.size(), group.rank()
    incoming = torch.empty_like(chunks[receive])
    work = None
    if chunks[send].numel():
        work = dist.isend(chunks[send], group=group, group_dst=(r + 1) % p, tag=tag)
    if incoming.numel():
        dist.recv(incoming, group=group, group_src=(r - 1) % p, tag=tag)
    if work is not None:
        work.wait()
    return incoming
