"""Parameters sharded across servers, balanced by bytes (BytePS / MXNet KVStore balance keys by
size so that no server carries more traffic than the others).

Greedy longest-processing-time: the largest tensor goes to the least-loaded server, ties to the
lowest server; every rank computes the same assignment from the same model, so no message is
needed to agree on it. Its largest load is at most 4/3 of the optimum (Graham's bound).
"""

from __future__ import annotations

import torch


def shard_by_bytes(sizes: list[int], servers: int) -> list[int]:
    """The server of each tensor, given each tensor's size in bytes."""
    load = [0] * servers
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        server = min(range(servers), key=lambda s: (load[s], s))
        owner[i] = server
        load[server] += sizes[i]
    return owner


def shards_of(params: list[torch.Tensor], servers: int) -> list[list[torch.Tensor]]:
    """``params`` split by the server that owns each, in model order within a shard."""
    owner = shard_by_bytes([p.numel() * p.element_size() for p in params], servers)
    return [[p for p, o in zip(params, owner) if o == s] for s in range(servers)]


def flat(tensors: list[torch.Tensor], *trailer: float) -> torch.Tensor:
    """One fp32 message: the tensors flattened, then a few header numbers (version, lr, norm)."""
    device = tensors[0].device
    return torch.cat(
        [t.detach().reshape(-1).float() for t in tensors]
        + [torch.tensor(trailer, dtype=torch.float32, device=device)]
    )


def unflatten_into(message: torch.Tensor, tensors: list[torch.Tensor]) -> list[float]:
    """Copy a message's body into ``tensors`` in place; return its trailer."""
    offset = 0
    for t in tensors:
        t.copy_(message[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
    return message[offset:].tolist()
