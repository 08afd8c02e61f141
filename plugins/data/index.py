"""The on-disk format ``plait prepare`` writes and ``data=shards`` reads::

    <dir>/
      shard_000000.bin ...  fixed-size token shards (the last may be shorter), each with llm.c's
                            header: 256 int32 (magic 20240520, version 1 = uint16 / 2 = uint32
                            tokens, token count), then the tokens
      documents.npy         int64 token offsets of every document start, then the end offset
      tokenizer.json        the HF tokenizer the ids come from (none for bytes)
      index.json            written last: format, tokenizer name, identity and vocab size, token
                            dtype, shard size, every shard's file, token count and xxh3_64
                            checksum (of the whole file), totals

The token stream is the documents in input order, each followed by the tokenizer's
``<|endoftext|>`` where it has one; shards cut that stream every ``shard_tokens`` tokens, so a
document may continue in the next shard. Everything is read through fsspec, so ``<dir>`` may be
a local directory or any fsspec URL.

A shard is checked against its checksum when it enters the node-local cache, and when read in
place with ``data.verify=true`` (:func:`checksum_of`, :func:`verify`); a mismatch raises
:class:`ShardChecksumError` naming the file and both checksums. An index written before the
checksums (no ``xxh3_64`` entries) is read without them: see ``docs/data.md``.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FORMAT = "plait-shards-v1"
MAGIC = 20240520  # llm.c's data file magic
HEADER_BYTES = 256 * 4
VERSION_OF_DTYPE = {"uint16": 1, "uint32": 2}  # llm.c: 1 = GPT-2 (uint16), 2 = uint32 ids
CHECKSUM = "xxh3_64"  # xxhash's 64-bit XXH3 of a whole shard file, as 16 hex digits
HASH_CHUNK = 1 << 23
INDEX = "index.json"
DOCUMENTS = "documents.npy"
TOKENIZER = "tokenizer.json"


def shard_name(k: int) -> str:
    return f"shard_{k:06d}.bin"


def token_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 2**16 else "uint32"


def shard_header(n_tokens: int, dtype: str) -> bytes:
    header = np.zeros(256, dtype=np.int32)
    header[:3] = (MAGIC, VERSION_OF_DTYPE[dtype], n_tokens)
    return header.tobytes()


def join(root: str, name: str) -> str:
    return f"{root.rstrip('/')}/{name}"


class ShardIndexError(ValueError):
    """A shard directory that cannot be trained on; the message names the fix."""


class ShardChecksumError(ValueError):
    """A shard whose bytes are not those its index records: corrupt or truncated."""


def checksum_of(f) -> str:
    """The xxh3_64 of a binary file object's bytes from where it stands to its end."""
    import xxhash

    digest = xxhash.xxh3_64()
    while chunk := f.read(HASH_CHUNK):
        digest.update(chunk)
    return digest.hexdigest()


def verify(name: str, actual: str, expected: str | None) -> None:
    """Refuse shard ``name`` (a path or URL) when its checksum is not the index's."""
    if expected is not None and actual != expected:
        raise ShardChecksumError(
            f"shard {name} is corrupt or truncated: its {CHECKSUM} is {actual}, but index.json "
            f"records {expected}; it is not read: restore the file, or run plait prepare again"
        )


@dataclass
class ShardIndex:
    """A prepared directory's index, with its document offsets loaded."""

    root: str  # the directory or URL as given
    tokenizer: dict  # name, identity, vocab_size, eot
    dtype: str
    shard_tokens: int
    shard_sizes: list[int]  # tokens per shard
    documents: np.ndarray  # int64, len = number of documents + 1
    fingerprint: str
    checksums: list  # each shard's xxh3_64, or None (an index written before checksums)

    @property
    def total_tokens(self) -> int:
        return int(self.documents[-1])

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype).itemsize

    def shard_bytes(self, k: int) -> int:
        return HEADER_BYTES + self.shard_sizes[k] * self.itemsize

    def shard_file(self, k: int) -> str:
        return join(self.root, shard_name(k))

    @property
    def has_checksums(self) -> bool:
        return all(c is not None for c in self.checksums)


def read_index(root: str, setting: str = "data.path") -> ShardIndex:
    """Read and check ``root``'s index; raises :class:`ShardIndexError` naming ``setting`` and the
    fix for a missing, partial or corrupt one. Shards are checked by size (one listing)."""
    from fsspec.core import url_to_fs

    try:
        fs, path = url_to_fs(root)
        listing = {Path(e["name"]).name: e for e in fs.ls(path, detail=True)}
    except FileNotFoundError:
        raise ShardIndexError(
            f"{setting}={root} does not exist: give the out= directory of a plait prepare run"
        ) from None
    except Exception as e:  # an unknown protocol, a missing fsspec backend, a network error
        raise ShardIndexError(
            f"{setting}={root} cannot be reached ({type(e).__name__}: {e}): "
            "check the path, or install the fsspec backend for its "
            "protocol"
        ) from None
    if INDEX not in listing:
        hint = (
            "its plait prepare did not finish: run the same plait prepare again to resume"
            if "work" in listing
            else f"make one with `plait prepare data.path=<text files> out={root}`"
        )
        raise ShardIndexError(f"{setting}={root} holds no {INDEX}: {hint}")
    fix = f"run plait prepare again with out={root}"
    try:
        meta = json.loads(fs.cat_file(join(path, INDEX)))
        if meta.get("format") != FORMAT:
            raise ValueError(f"format {meta.get('format')!r} is not {FORMAT!r}")
        documents = np.load(io.BytesIO(fs.cat_file(join(path, DOCUMENTS))))
        index = ShardIndex(
            root=root,
            tokenizer=dict(meta["tokenizer"]),
            dtype=meta["dtype"],
            shard_tokens=int(meta["shard_tokens"]),
            shard_sizes=[int(s["tokens"]) for s in meta["shards"]],
            documents=documents.astype(np.int64, copy=False),
            fingerprint=meta["fingerprint"],
            checksums=[s.get(CHECKSUM) for s in meta["shards"]],
        )
    except Exception as e:
        raise ShardIndexError(
            f"{setting}={root}: {INDEX} or {DOCUMENTS} is corrupt ({type(e).__name__}: {e}): {fix}"
        ) from None
    problems = index_problems(index, listing)
    if problems:
        raise ShardIndexError(f"{setting}={root}: {problems[0]}: {fix}")
    return index


def index_problems(index: ShardIndex, listing: dict) -> list[str]:
    sizes = index.shard_sizes
    if index.dtype not in VERSION_OF_DTYPE or index.tokenizer.get("vocab_size", 0) < 1:
        return [f"{INDEX} names dtype {index.dtype!r} / vocab {index.tokenizer.get('vocab_size')}"]
    if any(s != index.shard_tokens for s in sizes[:-1]) or not 0 < sizes[-1] <= index.shard_tokens:
        return [f"{INDEX} lists shards that are not {index.shard_tokens} tokens each"]
    docs = index.documents
    if (
        docs.ndim != 1
        or len(docs) < 2
        or docs[0] != 0
        or docs[-1] != sum(sizes)
        or np.any(np.diff(docs) <= 0)
    ):
        return [f"{DOCUMENTS} does not cut the {sum(sizes)} tokens into documents"]
    for k in range(len(sizes)):
        entry = listing.get(shard_name(k))
        if entry is None:
            return [f"{shard_name(k)} is missing"]
        if entry.get("size") != index.shard_bytes(k):
            return [f"{shard_name(k)} holds {entry.get('size')} bytes, not {index.shard_bytes(k)}"]
    return []
