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
it differs only by the order of the additions.
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
    p, r = group.size(), group.rank()
    if p == 1:
        return
    chunks = tensor.tensor_split(p)
    right, left = (r + 1) % p, (r - 1) % p

    def pass_along(send: int, receive: int) -> torch.Tensor:
        """Send one chunk right, receive one from the left (a chunk of a buffer shorter than
        the ring is empty, and then is neither sent nor received)."""
        incoming = torch.empty_like(chunks[receive])
        work = dist.isend(chunks[send], group=group, group_dst=right) if chunks[send].numel() \
            else None
        if incoming.numel():
            dist.recv(incoming, group=group, group_src=left)
        if work is not None:
            work.wait()
        return incoming

    for s in range(p - 1):  # reduce-scatter
        send, receive = (r - s) % p, (r - s - 1) % p
        chunks[receive].add_(pass_along(send, receive))
    for s in range(p - 1):  # all-gather
        send, receive = (r + 1 - s) % p, (r - s) % p
        chunks[receive].copy_(pass_along(send, receive))
