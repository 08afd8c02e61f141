"""Which tokens of a sequence each context-parallel rank holds.

A sequence of ``T`` tokens is cut into ``n`` equal chunks; rank ``r`` of ``C`` holds some of
them, concatenated in ascending order, and so do its queries, keys, values and every activation
between the input and the loss.

- **Zigzag** (ring attention; Megatron-core's and torchtitan's load balancing, ring-flash-
  attention's ``zigzag``): ``n = 2C`` chunks, rank ``r`` holds chunks ``r`` and ``2C - 1 - r``.
  Under a causal mask the work of query chunk ``i`` grows with ``i``; pairing an early chunk with
  a late one gives every rank the same number of visible query-key pairs, ``2C`` chunk-pairs'
  worth (the diagonal ones half full), where contiguous chunks would give rank ``C - 1`` a
  ``2C - 1`` times larger share than rank 0.
- **Contiguous** (Ulysses): rank ``r`` holds chunks ``r·k .. r·k + k - 1`` of ``n = k·C``, a
  contiguous run; after Ulysses' all-to-all every rank sees the whole sequence in order.

    T = 16, C = 2, zigzag:      rank 0: tokens 0-3 and 12-15    rank 1: tokens 4-11
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SequenceLayout:
    """The chunks of a ``seq_len``-token sequence that each of ``size`` ranks holds.

    ``chunks[r]``: rank ``r``'s chunk numbers (ascending), all ranks' together ``0 .. n - 1``.
    """

    seq_len: int
    size: int
    rank: int
    chunks: tuple[tuple[int, ...], ...]

    @classmethod
    def zigzag(cls, seq_len: int, size: int, rank: int) -> SequenceLayout:
        return cls(seq_len, size, rank, tuple((r, 2 * size - 1 - r) for r in range(size)))

    @classmethod
    def contiguous(cls, seq_len: int, size: int, rank: int, per_rank: int = 1) -> SequenceLayout:
        return cls(
            seq_len,
            size,
            rank,
            tuple(tuple(range(r * per_rank, (r + 1) * per_rank)) for r in range(size)),
        )

    def __post_init__(self) -> None:
        if self.seq_len % self.n_chunks:
            raise ValueError(
                f"a sequence of {self.seq_len} tokens cannot be cut into "
                f"{self.n_chunks} equal chunks"
            )

    @property
    def n_chunks(self) -> int:
        return sum(len(c) for c in self.chunks)

    @property
    def chunk_len(self) -> int:
        return self.seq_len // self.n_chunks

    @property
    def local_len(self) -> int:
        """Tokens of each sequence on one rank: ``seq_len / size``."""
        return len(self.chunks[self.rank]) * self.chunk_len

    def chunk_range(self, chunk: int) -> slice:
        return slice(chunk * self.chunk_len, (chunk + 1) * self.chunk_len)

    def index(self, rank: int | None = None, device=None) -> torch.Tensor:
        """The positions in the sequence of rank ``rank``'s tokens (default this rank's), in the
        order the rank holds them: what its inputs and targets are cut with."""
        chunks = self.chunks[self.rank if rank is None else rank]
        return torch.cat(
            [
                torch.arange(c * self.chunk_len, (c + 1) * self.chunk_len, device=device)
                for c in chunks
            ]
        )
