"""Token data: the embedded default (the Python standard library's source), a text file or
directory, or pre-tokenized ``.bin`` files; tokenized once into an on-disk cache.

- ``data=stdlib``: every ``.py`` file of the running Python's standard library, byte-level tokens
  (vocab 256). Needs no download, so a fresh machine trains at once.
- ``data=text data.path=corpus.txt`` (or a directory of text files): byte-level tokens.
- ``data=tokens data.path=train.bin``: nanoGPT-style uint16 token memmaps, used as they are; a
  directory holding ``train.bin`` and ``val.bin`` gives both splits.

The cache key is the tokenizer and the list of sources with their sizes and modification times,
so an edited corpus is re-tokenized and an unchanged one never is. On each node, local rank 0
writes the cache (temp file, then rename) while the others wait at a barrier.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from plait import hookimpl
from plait.config import DataConfig
from plait.types import Batch, PluginInfo

TOKENIZER = "bytes-v1"  # byte-level: token id = byte value


@dataclass
class DataFilesConfig(DataConfig):
    """Settings of ``data=stdlib|text|tokens``."""

    path: Optional[str] = None
    cache_dir: str = "${oc.env:PLAIT_CACHE_DIR,'~/.cache/plait'}"
    val_fraction: float = 0.01
    shuffle: bool = True  # a new permutation of the samples every epoch (read by sharding)


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
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)


def text_sources(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    return sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))


def cache_key(sources: list[Path]) -> str:
    digest = hashlib.sha256(TOKENIZER.encode())
    for p in sources:
        st = p.stat()
        digest.update(f"{p.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:24]


def tokenize_to_cache(sources: list[Path], cache_file: Path) -> None:
    """Byte-tokenize ``sources`` into ``cache_file`` (uint16) atomically."""
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache_file.with_suffix(f".tmp{os.getpid()}")
    with open(tmp, "wb") as out:
        for p in sources:
            out.write(np.frombuffer(p.read_bytes() + b"\n", dtype=np.uint8).astype(np.uint16))
    os.replace(tmp, cache_file)
    cache_file.with_suffix(".json").write_text(
        json.dumps({"tokenizer": TOKENIZER, "sources": [str(s) for s in sources]}, indent=0)
    )


def cached_tokens(sources: list[Path], cache_dir: Path, local_rank: int) -> Path:
    """The cache file for ``sources``; local rank 0 writes it if missing, the rest wait."""
    cache_file = cache_dir / "tokens" / f"{cache_key(sources)}.bin"
    if local_rank == 0 and not cache_file.exists():
        tokenize_to_cache(sources, cache_file)
    if dist.is_initialized():
        dist.barrier()
    return cache_file


def token_file(cfg, local_rank: int, split: str) -> tuple[Path, bool]:
    """The token file for ``split`` and whether it still needs cutting into train/val."""
    data = cfg.data
    if data.name == "tokens":
        path = Path(data.path).expanduser()
        if path.is_dir():
            return path / f"{split}.bin", False
        return path, True
    sources = stdlib_sources() if data.name == "stdlib" else text_sources(Path(data.path).expanduser())
    return cached_tokens(sources, Path(data.cache_dir).expanduser(), local_rank), True


def load_split(tokens: np.ndarray, val_fraction: float, split: str) -> np.ndarray:
    cut = int(len(tokens) * (1 - val_fraction))
    return tokens[:cut] if split == "train" else tokens[cut:]


@hookimpl
def plait_declare() -> PluginInfo:
    return PluginInfo(name="data", selected_by={"data.name": ("stdlib", "text", "tokens")},
                      description="byte-level text and token-file datasets with a disk cache")


@hookimpl
def plait_register_configs(config_store) -> None:
    config_store.store(group="data", name="base_files", node=DataFilesConfig)


@hookimpl
def plait_validate(cfg) -> list[str]:
    data = cfg.data
    if data.name == "stdlib":
        return []
    if data.path is None:
        return [f"data={data.name} needs data.path: give a "
                f"{'text file or directory' if data.name == 'text' else '.bin token file'}"]
    path = Path(data.path).expanduser()
    if not path.exists():
        return [f"data.path={data.path} does not exist: give an existing "
                f"{'text file or directory' if data.name == 'text' else '.bin file or directory'}"]
    if data.name == "tokens" and path.is_dir() and not (path / "train.bin").exists():
        return [f"data.path={data.path} is a directory without train.bin: give a .bin file or a "
                "directory with train.bin and val.bin"]
    return []


@hookimpl
def plait_build_dataset(cfg, topology, split: str) -> TokenWindows:
    path, needs_split = token_file(cfg, topology.local_rank, split)
    tokens = np.memmap(path, dtype=np.uint16, mode="r")
    if needs_split:
        tokens = load_split(tokens, cfg.data.val_fraction, split)
    return TokenWindows(tokens, cfg.train.seq_len)
