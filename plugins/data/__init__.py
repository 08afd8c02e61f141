"""Token data: the embedded default (the Python standard library's source), a text file or
directory, or pre-tokenized ``.bin`` files; tokenized once into an on-disk cache.

- ``data=stdlib``: every ``.py`` file of the running Python's standard library, byte-level tokens
  (vocab 256). Needs no download, so a fresh machine trains at once.
- ``data=text data.path=corpus.txt`` (or a directory, a glob, a URL): byte-level tokens of every
  document in any format ``plait prepare`` reads (:mod:`plait.plugins.data.formats`: a plain
  file is one document; JSON lines, parquet and ``datasets`` rows give ``data.text_field``),
  each followed by a newline.
- ``data=tokens data.path=train.bin``: token files as nanoGPT or llm.c write them (see
  :mod:`plait.plugins.data.token_files`), memory-mapped as they are; a directory holding
  ``train.bin`` and ``val.bin`` gives both splits.

Before launch the plan check reads only sizes and headers: a file that is not a token file, data
too short for one batch, or token ids beyond the model's vocabulary (the first 16M tokens are
scanned) are refused.

The cache key is the tokenizer and the list of sources with their sizes and modification times,
so an edited corpus is re-tokenized and an unchanged one never is. The standard library's key is
the tokenizer, the library's directory and the interpreter's version (:func:`stdlib_key`): its
files change only with the interpreter, and a launch lists none of them. On each node, local
rank 0 writes the cache (temp file, then rename) while the others wait at a barrier.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

import numpy as np
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from plait import hookimpl
from plait.config import CACHE_DIR, Range, range_problems
from plait.meta import meta_model
from plait.plugins.data.sharding import LoaderSettings
from plait.plugins.data.token_files import looks_like_text, read_tokens, token_layout
from plait.types import Batch, PluginInfo

TOKENIZER = "bytes-v1"  # byte-level: token id = byte value
BYTE_VOCAB = 256
SCAN_TOKENS = 1 << 24  # token ids checked against the model's vocabulary before launch


@dataclass
class DataFilesConfig(LoaderSettings):
    """Settings of ``data=stdlib|text|tokens`` (and the loader's, read by sharding)."""

    path: Optional[str] = None
    cache_dir: str = CACHE_DIR
    val_fraction: float = 0.01
    text_field: str = "text"  # data=text: the text of a JSON line, a parquet or datasets row


RANGES = {"val_fraction": Range(0, 1, high_open=True)}


class TokenWindows:
    """Non-overlapping windows of ``seq_len + 1`` tokens over a token array (inputs, targets)."""

    def __init__(self, tokens: np.ndarray, seq_len: int):
        if len(tokens) <= seq_len:
            raise ValueError(
                f"the data holds {len(tokens)} tokens, fewer than one sample of "
                f"train.seq_len={seq_len}: lower train.seq_len or give more data"
            )
        self.tokens = tokens
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def batch(self, indices: list[int]) -> Batch:
        T = self.seq_len
        rows = np.stack([self.tokens[i * T : i * T + T + 1] for i in indices]).astype(np.int64)
        rows = torch.from_numpy(rows)
        return rows[:, :-1], rows[:, 1:]


def stdlib_sources() -> list[Path]:
    """The standard library's ``.py`` files, without ``site-packages`` (pruned from the walk,
    not filtered after it: walking the installed packages cost every worker ~0.6 s), as
    absolute paths under the library's resolved directory (:func:`cache_key` resolves no
    absolute path again: 0.1 s of every worker for 1,800 files)."""
    sources = []
    for directory, subdirectories, files in os.walk(
        Path(sysconfig.get_paths()["stdlib"]).resolve()
    ):
        subdirectories[:] = [d for d in subdirectories if d != "site-packages"]
        sources += [Path(directory, f) for f in files if f.endswith(".py")]
    return sorted(sources)


def stdlib_key() -> str:
    """The cache key of ``data=stdlib``: the tokenizer, the standard library's resolved directory
    and this interpreter's version (with its build date), which every change of the library's
    files comes with. Listing the library's 1,800 files and reading their sizes and times
    instead (:func:`cache_key`) cost each worker 0.1 s of CPU at every launch."""
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    identity = f"{TOKENIZER}\0stdlib\0{stdlib}\0{sys.version}"
    return hashlib.sha256(identity.encode()).hexdigest()[:24]


def stdlib_tokens(cache_dir: Path, local_rank: int, group=None) -> Path:
    """The cache file of ``data=stdlib``, keyed by :func:`stdlib_key`: the library is listed
    only when the file is written (see :func:`tokens_at`)."""
    return tokens_at(
        cache_dir / "tokens" / f"{stdlib_key()}.bin", stdlib_sources, local_rank, group
    )


def text_sources(path) -> list:
    """The sources ``data.path`` names (:mod:`plait.plugins.data.sources`); ``ValueError``
    naming it when it names none."""
    from plait.plugins.data.sources import find_sources

    return find_sources([str(path)], "train", None)


def document_bytes(sources: list, text_field: str = "text") -> Iterator[bytes]:
    """Each document's bytes: a path's whole file (the standard library), or each document of
    a source in its format, read and checked as ``plait prepare`` reads it."""
    from plait.plugins.data.formats import read_documents, scan

    for source in sources:
        if isinstance(source, Path):
            yield source.read_bytes()
            continue
        for piece in scan(source, text_field, 1 << 20, "train", None):
            for text, _, _ in read_documents(
                source, piece.start, piece.end, text_field, "train", None
            ):
                yield text if isinstance(text, bytes) else text.encode()


def cache_key(sources: list, text_field: str = "text") -> str:
    digest = hashlib.sha256(TOKENIZER.encode())
    for p in sources:
        if isinstance(p, Path):
            st = p.stat()
            path = p if p.is_absolute() else p.resolve()
            digest.update(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        else:
            digest.update(f"{p.path}\0{p.format}\0{p.key}\0{text_field}\n".encode())
    return digest.hexdigest()[:24]


def tokenize_to_cache(sources: list, cache_file: Path, text_field: str = "text") -> None:
    """Byte-tokenize ``sources`` (each document, then a newline) into ``cache_file`` (uint16)
    atomically."""
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache_file.with_suffix(f".tmp{os.getpid()}")
    with open(tmp, "wb") as out:
        for doc in document_bytes(sources, text_field):
            out.write(np.frombuffer(doc + b"\n", dtype=np.uint8).astype(np.uint16))
    os.replace(tmp, cache_file)
    cache_file.with_suffix(".json").write_text(
        json.dumps(
            {"tokenizer": TOKENIZER, "sources": [str(getattr(s, "path", s)) for s in sources]},
            indent=0,
        )
    )


def cached_tokens(
    sources: list, cache_dir: Path, local_rank: int, group=None, text_field: str = "text"
) -> Path:
    """The cache file for ``sources``, keyed by :func:`cache_key` (see :func:`tokens_at`)."""
    cache_file = cache_dir / "tokens" / f"{cache_key(sources, text_field)}.bin"
    return tokens_at(cache_file, lambda: sources, local_rank, group, text_field)


def tokens_at(
    cache_file: Path,
    list_sources: Callable[[], list],
    local_rank: int,
    group=None,
    text_field: str = "text",
) -> Path:
    """``cache_file``, which local rank 0 (a node's first trainer) writes from
    ``list_sources()`` if missing while the rest of ``group`` (the trainers; None: every rank)
    wait."""
    if local_rank == 0 and not cache_file.exists():
        tokenize_to_cache(list_sources(), cache_file, text_field)
    if dist.is_initialized():
        dist.barrier(group=group)
    return cache_file


def token_file(cfg, local_rank: int, split: str, group=None) -> tuple[Path, bool]:
    """The token file for ``split`` and whether it still needs cutting into train/val."""
    data = cfg.data
    if data.name == "tokens":
        path = Path(data.path).expanduser()
        if path.is_dir():
            return path / f"{split}.bin", False
        return path, True
    if data.name == "stdlib":
        return stdlib_tokens(Path(data.cache_dir).expanduser(), local_rank, group), True
    return cached_tokens(
        text_sources(expand(data.path)),
        Path(data.cache_dir).expanduser(),
        local_rank,
        group,
        OmegaConf.select(data, "text_field", default="text"),
    ), True


def expand(path: str) -> str:
    return path if "://" in path else os.path.expanduser(path)


def load_split(tokens: np.ndarray, val_fraction: float, split: str) -> np.ndarray:
    cut = int(len(tokens) * (1 - val_fraction))
    return tokens[:cut] if split == "train" else tokens[cut:]


@hookimpl
def plait_declare() -> PluginInfo:
    return PluginInfo(
        name="data",
        selected_by={"data.name": ("stdlib", "text", "tokens")},
        description="byte-level text and token-file datasets with a disk cache",
    )


@hookimpl
def plait_register_configs(config_store) -> None:
    config_store.store(group="data", name="base_files", node=DataFilesConfig)


@hookimpl
def plait_validate(cfg, dims, hook) -> list[str]:
    data = cfg.data
    problems = range_problems("data", data, RANGES)
    if data.name == "stdlib":
        if data.path is not None:
            problems.append(
                f"data.path={data.path} is ignored by data=stdlib (the standard "
                "library's source): add data=text to train on a text file or "
                "directory, or data=tokens for token files"
            )
        if cfg.train.eval_every and data.val_fraction == 0:
            problems.append(
                f"train.eval_every={cfg.train.eval_every} with data.val_fraction=0 "
                "leaves no validation split: raise data.val_fraction, or set "
                "train.eval_every=0"
            )
        return problems + vocabulary_problems(cfg, hook, BYTE_VOCAB - 1, "data=stdlib")
    problems += path_problems(data, cfg.train.eval_every)
    if problems:
        return problems
    try:
        (train_tokens, val_tokens), max_id = split_tokens(data)
    except ValueError as e:
        return [f"data.path={data.path}: {e}"]
    return split_problems(cfg, dims, train_tokens, val_tokens) + vocabulary_problems(
        cfg, hook, max_id, f"data.path={data.path}"
    )


def split_tokens(data) -> tuple[tuple[int, int], int]:
    """Tokens in the train and validation splits, and the largest token id (in the first
    ``SCAN_TOKENS`` of each file), from sizes and headers: nothing is tokenized here."""
    if data.name == "text":
        return split_sizes(
            text_tokens(text_sources(expand(data.path)), data.text_field), data.val_fraction
        ), BYTE_VOCAB - 1
    path = Path(data.path).expanduser()
    files = [path / "train.bin", path / "val.bin"] if path.is_dir() else [path]
    counts, max_id = [], 0
    for file in (f for f in files if f.exists()):  # val.bin: only needed for evaluation
        if looks_like_text(file):
            raise ValueError(
                f"{file} looks like text, not tokens: to train on it as text use "
                f"data=text data.path={data.path}"
            )
        counts.append(token_layout(file).n_tokens)
        max_id = max(max_id, int(read_tokens(file)[:SCAN_TOKENS].max()))
    if path.is_dir():
        return (*counts, 0)[:2], max_id
    return split_sizes(counts[0], data.val_fraction), max_id


def text_tokens(sources: list, text_field: str) -> int:
    """Byte tokens of ``data=text``'s documents and their newlines: a plain file's from its
    size; other formats' by reading them (so they are checked before launch too)."""
    from plait.plugins.data.formats import TEXT

    total = 0
    for source in sources:
        if source.format == TEXT and source.compression is None:
            total += source.size + 1
        else:
            total += sum(len(doc) + 1 for doc in document_bytes([source], text_field))
    return total


def path_problems(data, eval_every: int) -> list[str]:
    what = "text file or directory" if data.name == "text" else ".bin token file or directory"
    if data.path is None:
        return [f"data={data.name} needs data.path: give a {what}"]
    if data.name == "text":
        try:
            text_sources(expand(data.path))
        except ValueError as e:
            return [str(e) if "data.path" in str(e) else f"data.path={data.path}: {e}"]
        return []
    path = Path(data.path).expanduser()
    if not path.exists():
        return [f"data.path={data.path} does not exist: give an existing {what}"]
    if data.name == "tokens" and path.is_dir():
        needed = ("train.bin", "val.bin") if eval_every else ("train.bin",)
        missing = [name for name in needed if not (path / name).is_file()]
        if missing:
            return [
                f"data.path={data.path} is a directory without {' and '.join(missing)}: give "
                "a .bin file or a directory with train.bin (and val.bin for train.eval_every)"
            ]
    return []


def split_sizes(n_tokens: int, val_fraction: float) -> tuple[int, int]:
    cut = int(n_tokens * (1 - val_fraction))
    return cut, n_tokens - cut


def split_problems(cfg, dims, train_tokens: int, val_tokens: int) -> list[str]:
    """Data too short for one global batch, or (with evaluation on) a validation split too short
    for one per-rank batch: what the workers would otherwise fail on."""
    train, seq_len = cfg.train, cfg.train.seq_len
    problems = []
    samples = max(train_tokens - 1, 0) // seq_len
    if samples < train.batch_size:
        problems.append(
            f"data.path={cfg.data.path}: the train split holds {train_tokens} tokens "
            f"= {samples} samples of train.seq_len={seq_len}, fewer than one global "
            f"batch of train.batch_size={train.batch_size}: lower train.batch_size "
            "or train.seq_len, or give more data"
        )
    per_rank = train.batch_size // dims.dp
    val_samples = max(val_tokens - 1, 0) // seq_len
    if train.eval_every and val_samples < per_rank:
        problems.append(
            f"train.eval_every={train.eval_every}: the validation split holds "
            f"{val_tokens} tokens = {val_samples} samples of train.seq_len={seq_len}, "
            f"fewer than one per-rank batch of {per_rank}: raise data.val_fraction "
            "(or give a longer val.bin), or set train.eval_every=0"
        )
    return problems


def vocabulary_problems(cfg, hook, max_id: int, source: str) -> list[str]:
    """Token ids the model's input embedding has no row for (an index error in every worker)."""
    model = meta_model(hook, cfg)
    modules = model.modules() if model is not None else ()
    embedding = next((m for m in modules if isinstance(m, torch.nn.Embedding)), None)
    if embedding is None or max_id < embedding.num_embeddings:
        return []
    return [
        f"{source} holds token ids up to {max_id}, but the model's embedding has "
        f"{embedding.num_embeddings} rows: raise the model's vocabulary to at least "
        f"{max_id + 1} (model.vocab_size for plait's GPT and Llama)"
    ]


@hookimpl
def plait_tokenizer(cfg):
    """Bytes for the standard library and text files; token files do not say."""
    if cfg.data.name == "tokens":
        return None
    from plait.plugins.data.tokenizer import ByteTokenizer

    return ByteTokenizer()


@hookimpl
def plait_build_dataset(cfg, topology, split: str) -> TokenWindows:
    path, needs_split = token_file(cfg, topology.local_trainer_rank, split, topology.trainer_group)
    tokens = read_tokens(path)
    if needs_split:
        tokens = load_split(tokens, cfg.data.val_fraction, split)
    return TokenWindows(tokens, cfg.train.seq_len)
