"""Training samples over prepared shards: windows of ``seq_len + 1`` tokens, their order per
epoch, and where their tokens are read from.

Samples (Megatron's GPT dataset, simplified): with ``data.pack=false`` each document is cut into
non-overlapping windows and a remainder shorter than a window is dropped, so no sample crosses a
document boundary; with ``data.pack=true`` the windows run over the whole token stream and each
sample also carries every input token's position in its document (restarting at 0 where a
document starts, at 0 for the window's first token: Megatron's ``reset_position_ids``, HF's packed
``position_ids``), from which the model masks attention across documents. The validation split is
the last ``data.val_fraction`` of the documents.

The order of an epoch (MosaicML Streaming's ``py1b`` shuffle, in samples): the shards are
permuted, their samples concatenated, and the samples of each block of ``data.shuffle_block``
consecutive ones permuted, all seeded by ``(seed, epoch)``. Sample ``i`` is then near the shards
the neighbouring samples read, so a node's cache holds only a window of shards at a time.
"""

from __future__ import annotations

import os
from functools import lru_cache
from typing import Optional

import numpy as np
import torch

from plait.plugins.data.cache import NodeCache, shard_keys_in_order
from plait.plugins.data.index import (
    HEADER_BYTES,
    ShardChecksumError,
    ShardIndex,
    checksum_of,
    shard_name,
    verify,
)


def verify_file(path: str, index: ShardIndex, k: int) -> None:
    """Check a local copy of shard ``k`` against its size and checksum (``data.verify=true``)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size != index.shard_bytes(k):
            raise ShardChecksumError(
                f"shard {path} is truncated or grown: {size} bytes, but index.json records "
                f"{index.shard_bytes(k)}; it is not read: restore the file, or run plait "
                "prepare again"
            )
        verify(path, checksum_of(f), index.checksums[k])


class LocalShards:
    """Shards on a local (or mounted) file system, memory-mapped where they lie; with
    ``verify``, each is checked against its checksum when this process first maps it."""

    remote = False

    def __init__(self, index: ShardIndex, verify: bool = False):
        self.index, self.verify = index, verify
        self._maps: dict[int, np.memmap] = {}

    def __getstate__(self):
        return {**self.__dict__, "_maps": {}}

    def read(self, k: int, offset: int, count: int) -> np.ndarray:
        if k not in self._maps:
            path = self.index.shard_file(k)
            if self.verify:
                verify_file(path, self.index, k)
            self._maps[k] = np.memmap(path, dtype=self.index.dtype, mode="r", offset=HEADER_BYTES)
        return self._maps[k][offset : offset + count]


class CachedShards:
    """Shards of a remote dataset, read from the node-local cache (fetched on demand and checked
    as they enter it); with ``verify``, the cached copy is checked again when this process first
    reads it."""

    remote = True

    def __init__(self, index: ShardIndex, cache: NodeCache, verify: bool = False):
        self.index, self.cache, self.verify = index, cache, verify
        self._verified: set[int] = set()

    def __getstate__(self):
        return {**self.__dict__, "_verified": set()}

    def fetch(self, k: int) -> None:
        self.cache.ensure(shard_name(k), self.index.shard_bytes(k), self.index.checksums[k])

    def read(self, k: int, offset: int, count: int) -> np.ndarray:
        itemsize = self.index.itemsize
        if self.verify and k not in self._verified:
            verify_file(
                str(
                    self.cache.ensure(
                        shard_name(k), self.index.shard_bytes(k), self.index.checksums[k]
                    )
                ),
                self.index,
                k,
            )
            self._verified.add(k)
        data = self.cache.read(
            shard_name(k),
            self.index.shard_bytes(k),
            HEADER_BYTES + offset * itemsize,
            count * itemsize,
            self.index.checksums[k],
        )
        return np.frombuffer(data, dtype=self.index.dtype)


def split_documents(documents: np.ndarray, val_fraction: float, split: str) -> np.ndarray:
    """Document offsets of ``split``: the last ``val_fraction`` of the documents (at least one
    when the fraction is positive) are validation."""
    n_docs = len(documents) - 1
    n_val = 0 if val_fraction <= 0 else min(max(1, round(n_docs * val_fraction)), n_docs - 1)
    cut = n_docs - n_val
    return documents[: cut + 1] if split == "train" else documents[cut:]


def window_starts(documents: np.ndarray, seq_len: int, pack: bool) -> np.ndarray:
    """Token offsets of every sample (``seq_len + 1`` tokens each), ascending."""
    if pack:
        lo, hi = int(documents[0]), int(documents[-1])
        return lo + np.arange(max(hi - lo - 1, 0) // seq_len, dtype=np.int64) * seq_len
    lengths = np.diff(documents)
    per_doc = np.maximum(lengths - 1, 0) // seq_len
    first = np.cumsum(per_doc) - per_doc  # the first sample of each document
    within = np.arange(per_doc.sum(), dtype=np.int64) - np.repeat(first, per_doc)
    return np.repeat(documents[:-1], per_doc) + within * seq_len


class ShardDataset:
    """One prepared directory's samples for one split (a :class:`plait.types.TokenDataset`)."""

    def __init__(
        self,
        index: ShardIndex,
        reader,
        seq_len: int,
        split: str,
        pack: bool,
        val_fraction: float,
        shuffle: bool,
        shuffle_block: int,
    ):
        self.index, self.reader, self.seq_len, self.pack = index, reader, seq_len, pack
        self.documents = split_documents(index.documents, val_fraction, split)
        self.starts = window_starts(self.documents, seq_len, pack)
        self.shuffle, self.shuffle_block = shuffle, shuffle_block
        self.fetches_remotely = reader.remote

    def __len__(self) -> int:
        return len(self.starts)

    def tokens(self, start: int, count: int) -> np.ndarray:
        """``count`` tokens of the stream from ``start``, across shard ends where needed."""
        k, offset = divmod(start, self.index.shard_tokens)
        parts = []
        while count > 0:
            take = min(count, self.index.shard_sizes[k] - offset)
            parts.append(self.reader.read(k, offset, take))
            count, k, offset = count - take, k + 1, 0
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def window(self, i: int) -> np.ndarray:
        return self.tokens(int(self.starts[i]), self.seq_len + 1)

    def positions(self, i: int) -> np.ndarray:
        """Sample ``i``'s input tokens' positions within their documents (within the window:
        a document that began before it starts at 0)."""
        start = int(self.starts[i])
        tokens = np.arange(start, start + self.seq_len, dtype=np.int64)
        doc_starts = self.documents[np.searchsorted(self.documents, tokens, side="right") - 1]
        return tokens - np.maximum(doc_starts, start)

    def batch(self, indices: list[int]):
        rows = torch.from_numpy(np.stack([self.window(i) for i in indices]).astype(np.int64))
        if not self.pack:
            return rows[:, :-1], rows[:, 1:]
        positions = torch.from_numpy(np.stack([self.positions(i) for i in indices]))
        return rows[:, :-1], rows[:, 1:], positions

    @lru_cache(maxsize=4)
    def epoch_order(self, seed: int, epoch: int) -> np.ndarray:
        n = len(self.starts)
        if not self.shuffle:
            return np.arange(n)
        rng = np.random.default_rng([seed, epoch])
        shard_of = self.starts // self.index.shard_tokens  # ascending: samples grouped by shard
        edges = np.searchsorted(shard_of, np.arange(len(self.index.shard_sizes) + 1))
        ids = np.concatenate(
            [np.arange(edges[k], edges[k + 1]) for k in rng.permutation(len(edges) - 1)]
        )
        block = np.arange(n) // self.shuffle_block
        return ids[np.lexsort((rng.random(n), block))]

    def shard_keys(self, indices: list[int]) -> list[int]:
        """The shards the samples read, in the order first needed."""
        starts = self.starts[indices]
        ends = (starts + self.seq_len) // self.index.shard_tokens
        return shard_keys_in_order(
            k
            for a, b in zip(starts // self.index.shard_tokens, ends)
            for k in range(int(a), int(b) + 1)
        )

    def fetch(self, key: int) -> None:
        self.reader.fetch(key)


def make_reader(
    index: ShardIndex, cache_dir: str, cache_limit_gb: Optional[float], verify: bool = False
):
    """Read a local directory in place; copy shards of a URL (``scheme://...``, including
    ``file://`` for a slow mounted directory) into the node-local cache."""
    if "://" not in index.root:
        return LocalShards(index, verify)
    limit = None if cache_limit_gb is None else int(cache_limit_gb * 2**30)
    return CachedShards(index, NodeCache(index.root, cache_dir, limit), verify)
