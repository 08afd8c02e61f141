"""Ring attention over the context-parallel group, a custom autograd function.

Each of the ``C`` ranks holds its queries, keys and values for its chunks of the sequence
(:mod:`.layout`). Forward, ``C`` steps: at step ``i`` rank ``r`` holds the keys and values of
rank ``r - i`` (its own at step 0), starts passing them on to rank ``r + 1`` while receiving
rank ``r - i - 1``'s from rank ``r - 1`` (``torch.distributed.batch_isend_irecv``), and attends
with its query chunks to the key chunks it may see. The partial results of the tiles are merged
by their log-sum-exp (:func:`.kernels.merge`), so the result is exact, not approximate::

    out_q = Σ_tiles out_t · exp(lse_t - lse_q)      lse_q = log Σ_tiles exp(lse_t)

Causality by chunk number: query chunk ``a`` sees key chunk ``b < a`` fully, ``b = a`` causally,
``b > a`` not at all (that tile is skipped); with zigzag chunks every rank computes the same
number of query-key pairs at every step. Packed documents add a mask from the document ids of
every token (all ranks hold all ids: they are cheap), so a tile whose queries and keys share no
document is skipped and attention never crosses a document boundary; document lengths need not
be multiples of anything.

Backward, its own ring (ring-flash-attention's scheme): the keys and values travel the same way
again, and with them an accumulator of their gradients: at step ``i`` rank ``r`` adds what its
queries give the keys and values of rank ``r - i`` to the accumulator it received, and passes it
on; after ``C`` steps each accumulator is back at its owner. What the forward keeps is only
this rank's ``q, k, v``, output and log-sum-exp: ``O(T/C)`` per rank.

Per layer and sequence of ``T`` tokens, ``h_kv`` key/value width and ``v`` bytes per value, each
rank sends ``(C - 1)·2·(T/C)·h_kv·v`` bytes forward and ``(2C - 1)·2·(T/C)·h_kv·v`` backward
(keys and values ``C - 1`` times, their gradients ``C`` times), in ``C - 1`` and ``2C - 1``
point-to-point exchanges.

Grouped-query attention (``h_kv`` key/value heads serving ``H`` query heads, ``g = H / h_kv``
each, as Llama-family models have): only the ``h_kv`` heads travel; each tile repeats them for
its query heads (``repeat_interleave``, query head ``i`` seeing key head ``i // g``, as
``transformers``' ``repeat_kv``), and the tile's key/value gradients are summed back over each
group of ``g`` before they travel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from plait.plugins.context_parallel.kernels import (
    NEG_INF,
    accumulation_dtype,
    merge,
    tile_backward,
    tile_forward,
)
from plait.plugins.context_parallel.layout import SequenceLayout

KV_TAG, GRAD_TAG = 1, 2  # gloo matches point-to-point messages by tag; NCCL ignores it


@dataclass
class ExchangeStats:
    """What one rank's context-parallel attention sent and computed, counted as it happens."""

    exchanges: int = 0  # point-to-point exchanges (ring) or all-to-alls (Ulysses)
    bytes_sent: int = 0
    attention_flops: int = 0  # forward matmul FLOPs of the attention tiles this rank computed

    def take(self) -> dict[str, int]:
        """The counts since the last call."""
        counts = {
            "exchanges": self.exchanges,
            "bytes_sent": self.bytes_sent,
            "attention_flops": self.attention_flops,
        }
        self.exchanges = self.bytes_sent = self.attention_flops = 0
        return counts


@dataclass(frozen=True)
class Tile:
    """Query chunk ``q_slot`` of this rank against key chunk ``k_slot`` of the keys held now."""

    q_slot: int
    k_slot: int
    causal: bool
    bias: torch.Tensor | None = None  # [b, 1, m, n]: 0 where visible, -inf where not
    visible_rows: torch.Tensor | None = None  # [b, m]: query rows that see some key

    def pairs(self, chunk_len: int) -> int:
        """Query-key pairs the kernel computes (a causal tile: the lower triangle)."""
        return chunk_len * (chunk_len + 1) // 2 if self.causal else chunk_len * chunk_len


def plan_tiles(layout: SequenceLayout, owner: int, documents: torch.Tensor | None) -> list[Tile]:
    """The tiles this rank computes against rank ``owner``'s keys; ``documents`` (``[b, T]``
    document ids of every token, or None) hides pairs in different documents."""
    tiles, n = [], layout.chunk_len
    for a, q_chunk in enumerate(layout.chunks[layout.rank]):
        for b, k_chunk in enumerate(layout.chunks[owner]):
            if q_chunk < k_chunk:
                continue
            causal = q_chunk == k_chunk
            if documents is None:
                tiles.append(Tile(a, b, causal))
                continue
            q_docs = documents[:, layout.chunk_range(q_chunk)]
            k_docs = documents[:, layout.chunk_range(k_chunk)]
            allowed = q_docs[:, :, None] == k_docs[:, None, :]
            by_order = torch.ones(n, n, dtype=torch.bool, device=allowed.device)
            if causal:
                by_order = by_order.tril()
                allowed &= by_order
            if not allowed.any():
                continue
            if bool((allowed == by_order).all()):  # one document throughout: no mask needed
                tiles.append(Tile(a, b, causal))
                continue
            bias = torch.zeros(allowed.shape, dtype=torch.float32, device=allowed.device)
            bias.masked_fill_(~allowed, NEG_INF)
            tiles.append(Tile(a, b, False, bias[:, None], allowed.any(-1)))
    return tiles


class Ring:
    """Neighbours on the ring of ``group``: send to the next rank, receive from the previous."""

    def __init__(self, group: dist.ProcessGroup, stats: ExchangeStats):
        self.group, self.stats = group, stats
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        self.next = dist.get_global_rank(group, (rank + 1) % size)
        self.prev = dist.get_global_rank(group, (rank - 1) % size)

    def exchange(self, tensor: torch.Tensor, tag: int) -> _Pending:
        """Start sending ``tensor`` to the next rank and receiving its like from the previous."""
        received = torch.empty_like(tensor)
        works = dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, tensor, self.next, self.group, tag),
                dist.P2POp(dist.irecv, received, self.prev, self.group, tag),
            ]
        )
        self.stats.exchanges += 1
        self.stats.bytes_sent += tensor.numel() * tensor.element_size()
        return _Pending(works, received)


class _Pending:
    def __init__(self, works, received: torch.Tensor):
        self.works, self.received = works, received

    def wait(self) -> torch.Tensor:
        for work in self.works:
            work.wait()
        return self.received


def chunk(x: torch.Tensor, slot: int, chunk_len: int) -> torch.Tensor:
    """Chunk ``slot`` of a ``[..., seq, d]`` tensor (the sequence is the second to last dim)."""
    return x[..., slot * chunk_len : (slot + 1) * chunk_len, :]


def expand_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``[b, h_kv, n, d]`` key/value heads repeated for ``h_kv · groups`` query heads."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def fold_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of :func:`expand_heads`: ``[b, h_kv · groups, n, d]`` summed per group."""
    if groups == 1:
        return x
    b, heads, n, d = x.shape
    return x.view(b, heads // groups, groups, n, d).sum(2)


class RingAttention(torch.autograd.Function):
    """``out = softmax(q·kᵀ·scale + mask)·v`` for this rank's queries against every rank's keys;
    ``q``: ``[b, H, T/C, d]``, ``k, v``: ``[b, h_kv, T/C, d]`` (``h_kv`` dividing ``H``), in the
    layout's order."""

    @staticmethod
    def forward(
        ctx, q, k, v, documents, layout: SequenceLayout, group, scale: float, stats: ExchangeStats
    ):
        ring, n = Ring(group, stats), layout.chunk_len
        slots = len(layout.chunks[layout.rank])
        outs, lses = [None] * slots, [None] * slots
        kv = torch.stack([k, v]).contiguous()
        groups = q.shape[1] // k.shape[1]
        flops_per_pair = 4 * q.shape[0] * q.shape[1] * q.shape[-1]
        for step in range(layout.size):
            owner = (layout.rank - step) % layout.size
            incoming = ring.exchange(kv, KV_TAG) if step < layout.size - 1 else None
            for tile in plan_tiles(layout, owner, documents):
                out, lse = tile_forward(
                    chunk(q, tile.q_slot, n),
                    expand_heads(chunk(kv[0], tile.k_slot, n), groups),
                    expand_heads(chunk(kv[1], tile.k_slot, n), groups),
                    tile.causal,
                    tile.bias,
                    tile.visible_rows,
                    scale,
                )
                a = tile.q_slot
                outs[a], lses[a] = merge(outs[a], lses[a], out, lse)
                stats.attention_flops += flops_per_pair * tile.pairs(n)
            if incoming is not None:
                kv = incoming.wait()
        out, lse = torch.cat(outs, dim=2).to(q.dtype), torch.cat(lses, dim=2)
        ctx.save_for_backward(q, k, v, out, lse, documents)
        ctx.layout, ctx.group, ctx.scale, ctx.stats = layout, group, scale, stats
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, documents = ctx.saved_tensors
        layout, n = ctx.layout, ctx.layout.chunk_len
        ring = Ring(ctx.group, ctx.stats)
        dout = dout.contiguous()
        dq = torch.zeros_like(q, dtype=accumulation_dtype(q.dtype))
        kv = torch.stack([k, v]).contiguous()
        groups = q.shape[1] // k.shape[1]
        grads_home = None  # the accumulator of key/value gradients arriving from the last rank
        for step in range(layout.size):
            owner = (layout.rank - step) % layout.size
            incoming = ring.exchange(kv, KV_TAG) if step < layout.size - 1 else None
            dkv = torch.zeros_like(kv, dtype=accumulation_dtype(kv.dtype))
            for tile in plan_tiles(layout, owner, documents):
                a, b = tile.q_slot, tile.k_slot
                dq_t, dk_t, dv_t = tile_backward(
                    chunk(dout, a, n),
                    chunk(q, a, n),
                    expand_heads(chunk(kv[0], b, n), groups),
                    expand_heads(chunk(kv[1], b, n), groups),
                    chunk(out, a, n),
                    lse[..., a * n : (a + 1) * n],
                    tile.causal,
                    tile.bias,
                    ctx.scale,
                )
                chunk(dq, a, n).add_(dq_t)
                chunk(dkv[0], b, n).add_(fold_heads(dk_t, groups))
                chunk(dkv[1], b, n).add_(fold_heads(dv_t, groups))
            if grads_home is not None:
                dkv += grads_home.wait()
            grads_home = ring.exchange(dkv, GRAD_TAG)
            if incoming is not None:
                kv = incoming.wait()
        dk, dv = grads_home.wait()
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None)
