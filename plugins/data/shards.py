"""``data=shards``: train on what ``plait prepare`` wrote, from a local directory or any fsspec
URL, one corpus or a weighted blend of several.

    plait prepare data.path=corpus/ out=shards/ data.tokenizer=bpe data.vocab_size=8192
    plait train data=shards data.path=shards/ model.vocab_size=8192
    plait train data=shards 'data.sources=[{path: a/, weight: 0.7}, {path: b/, weight: 0.3}]'
    plait train data=shards data.path=s3://bucket/shards data.cache_limit_gb=200

Before launch it refuses: a directory without a complete index, a corrupt index or missing
shard, an unreachable path, sources prepared with different tokenizers, a model whose output
has fewer ids than the tokenizer (asked of the model plugin: the model is built on the meta
device and run on one token), weights that do not sum to a positive number, a cache limit
smaller than one shard, too few samples for one global batch (or, with ``train.eval_every``, for
one per-rank validation batch), ``data.pack=true`` with a model whose forward takes no
``position_ids``, ``data.verify=true`` on an index without checksums, and numbers out of range
(``RANGES``).

Shards are checked against the xxh3_64 checksums of their index when they enter the node-local
cache (always) and when read in place with ``data.verify=true``; a corrupt or truncated shard
stops the run, naming the file and both checksums, before any of its tokens is trained on.
"""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass
from typing import Optional

import torch
from omegaconf import MISSING

from plait import hookimpl
from plait.config import AT_LEAST_1, CACHE_DIR, POSITIVE, Range, range_problems
from plait.meta import meta_model
from plait.plugins.data.blend import BlendedDataset
from plait.plugins.data.index import ShardIndex, ShardIndexError, read_index
from plait.plugins.data.shard_dataset import (
    ShardDataset,
    make_reader,
    split_documents,
    window_starts,
)
from plait.plugins.data.sharding import LoaderSettings
from plait.types import PluginInfo


@dataclass
class SourceConfig:
    path: str = MISSING
    weight: float = 1.0


@dataclass
class ShardsDataConfig(LoaderSettings):
    """Settings of ``data=shards``."""

    name: str = "shards"
    path: Optional[str] = None  # a prepared directory or fsspec URL
    sources: Optional[list[SourceConfig]] = None  # a weighted blend instead of one path
    pack: bool = False  # true: samples run across document boundaries
    shuffle_block: int = 1 << 18  # samples shuffled together (Streaming's shuffle_block_size)
    val_fraction: float = 0.01  # the last documents of each source
    cache_dir: str = CACHE_DIR  # node-local, for URLs
    cache_limit_gb: Optional[float] = None  # GiB the node's shard cache may hold; None: no limit
    prefetch_shards: int = 2  # shards fetched ahead of the loader
    verify: bool = False  # check each shard read in place (and each cached copy) by checksum


RANGES = {
    "shuffle_block": AT_LEAST_1,
    "val_fraction": Range(0, 1, high_open=True),
    "cache_limit_gb": POSITIVE,
    "prefetch_shards": Range(0, meaning="0: no prefetch"),
}


def sources_of(data) -> list[tuple[str, str, float]]:
    """``(setting, path, weight)`` of each source."""
    if data.sources:
        return [(f"data.sources[{i}].path", s.path, s.weight) for i, s in enumerate(data.sources)]
    return [("data.path", data.path, 1.0)]


def source_problems(data) -> list[str]:
    if (data.path is None) == (not data.sources):
        return [
            "data=shards needs data.path=<a prepared directory> or data.sources=[{path: ..., "
            "weight: ...}, ...] (not both)"
        ]
    weights = [w for _, _, w in sources_of(data)]
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        return [f"data.sources weights {weights} must be non-negative and sum to a positive number"]
    return []


def model_vocab_size(cfg, hook) -> Optional[int]:
    """The width of the model's output, from the model plugin: built on the meta device and
    run on one token. None when that model cannot run on the meta device."""
    model = meta_model(hook, cfg)
    if model is None:  # the model plugin's own check says why
        return None
    try:
        return int(model(torch.zeros(1, 1, dtype=torch.long, device="meta")).shape[-1])
    except Exception:
        return None


def packing_problems(cfg, hook) -> list[str]:
    """``data.pack=true`` gives the model each token's position in its document
    (``position_ids``), from which it masks attention across documents: a model whose forward
    takes none would fail in every worker."""
    model = meta_model(hook, cfg)
    if not cfg.data.pack or model is None:
        return []
    if "position_ids" in inspect.signature(model.forward).parameters:
        return []
    return [
        f"data.pack=true passes each token's position in its document to the model "
        f"(forward(ids, position_ids)), from which it masks attention across documents; "
        f"model._target_={cfg.model._target_} takes no position_ids: use a model that does "
        "(plait's GPT) or data.pack=false"
    ]


def index_problems(cfg, dims, hook, indexes: list[tuple[str, ShardIndex]]) -> list[str]:
    data, problems = cfg.data, []
    identities = {index.tokenizer["identity"] for _, index in indexes}
    if len(identities) > 1:
        names = ", ".join(
            f"{s}={i.root} ({i.tokenizer['name']}, {i.tokenizer['identity'][:19]})"
            for s, i in indexes
        )
        problems.append(
            f"the sources were tokenized differently: {names}: prepare them with one "
            "tokenizer (data.tokenizer=<the first one's tokenizer.json>)"
        )
    vocab = max(index.tokenizer["vocab_size"] for _, index in indexes)
    model_vocab = model_vocab_size(cfg, hook)
    if model_vocab is not None and model_vocab < vocab:
        problems.append(
            f"the model's output has {model_vocab} ids, fewer than the tokenizer's "
            f"vocabulary of {vocab} ({indexes[0][1].root}): set model.vocab_size="
            f"{vocab} (or a padded size above it)"
        )
    cached = [(i.shard_bytes(0), i.root) for _, i in indexes if "://" in i.root]
    if data.cache_limit_gb is not None and cached:
        size, root = max(cached)
        if data.cache_limit_gb * 2**30 < size:
            problems.append(
                f"data.cache_limit_gb={data.cache_limit_gb:g} is smaller than one "
                f"shard of {root} ({size / 2**30:.3g} GiB): raise it to hold a few "
                "shards"
            )
    for setting, index in indexes:
        n = samples_of(index, data, cfg.train.seq_len, "train")
        if n < (cfg.train.batch_size if len(indexes) == 1 else 1):
            problems.append(
                f"{setting}={index.root} holds {n} training samples of "
                f"train.seq_len={cfg.train.seq_len}, fewer than one global batch of "
                f"train.batch_size={cfg.train.batch_size}: lower them, set "
                "data.pack=true, or prepare more text"
            )
    for setting, index in indexes:
        if data.verify and not index.has_checksums:
            problems.append(
                f"data.verify=true, but {setting}={index.root} has an index.json "
                "without shard checksums (written by plait prepare before they "
                f"were recorded): run plait prepare again with out={index.root} "
                "into a new directory, or set data.verify=false"
            )
    per_rank = cfg.train.batch_size // dims.dp
    n_val = sum(samples_of(index, data, cfg.train.seq_len, "val") for _, index in indexes)
    if cfg.train.eval_every and n_val < per_rank:
        problems.append(
            f"train.eval_every={cfg.train.eval_every}: the validation split holds "
            f"{n_val} samples of train.seq_len={cfg.train.seq_len}, fewer than one "
            f"per-rank batch of {per_rank}: raise data.val_fraction, or set "
            "train.eval_every=0"
        )
    return problems


def samples_of(index: ShardIndex, data, seq_len: int, split: str) -> int:
    return len(
        window_starts(
            split_documents(index.documents, data.val_fraction, split), seq_len, data.pack
        )
    )


@hookimpl
def plait_declare() -> PluginInfo:
    return PluginInfo(
        name="shards",
        selected_by={"data.name": "shards"},
        description="prepared token shards, local or remote with a node-local "
        "cache, blended by weight",
    )


@hookimpl
def plait_register_configs(config_store) -> None:
    config_store.store(group="data", name="base_shards", node=ShardsDataConfig)


@hookimpl
def plait_register_commands(register) -> None:
    from plait.plugins.data.prepare import cmd_prepare

    register(
        "prepare",
        cmd_prepare,
        "tokenize a corpus (text, JSON lines, parquet, datasets; "
        "local or URLs) into checksummed shards for data=shards "
        "(data.path=... out=... [launcher=slurm])",
    )


@hookimpl
def plait_validate(cfg, dims, hook) -> list[str]:
    problems = range_problems("data", cfg.data, RANGES) + source_problems(cfg.data)
    if problems:
        return problems
    indexes = []
    for setting, path, _ in sources_of(cfg.data):
        try:
            indexes.append((setting, read_index(path, setting)))
        except ShardIndexError as e:
            problems.append(str(e))
    return problems or index_problems(cfg, dims, hook, indexes) + packing_problems(cfg, hook)


@hookimpl
def plait_tokenizer(cfg):
    """The tokenizer ``plait prepare`` made the (first) source with: bytes, or the
    ``tokenizer.json`` it saved beside the shards, with its end-of-text id."""
    from fsspec.core import url_to_fs

    from plait.plugins.data.index import TOKENIZER, join
    from plait.plugins.data.tokenizer import ByteTokenizer, HFTokenizer

    _, path, _ = sources_of(cfg.data)[0]
    try:
        index = read_index(path)
    except ShardIndexError:
        return None  # refused by plait_validate
    if index.tokenizer["name"] == ByteTokenizer.name:
        return ByteTokenizer()
    fs, root = url_to_fs(path)
    return HFTokenizer.from_json(
        fs.cat_file(join(root, TOKENIZER)).decode(),
        index.tokenizer["name"],
        index.tokenizer.get("eot"),
    )


@hookimpl
def plait_build_dataset(cfg, topology, split: str):
    data = cfg.data
    datasets, weights = [], []
    for setting, path, weight in sources_of(data):
        index = read_index(path, setting)
        if (
            "://" in path
            and not index.has_checksums
            and topology.is_logging_rank
            and split == "train"
        ):
            print(
                f"plait: warning: {setting}={path} has no shard checksums (an index.json "
                "written before plait prepare recorded them): its shards enter the cache "
                "unchecked; prepare it again to have them checked",
                file=sys.stderr,
                flush=True,
            )
        reader = make_reader(index, data.cache_dir, data.cache_limit_gb, data.verify)
        datasets.append(
            ShardDataset(
                index,
                reader,
                cfg.train.seq_len,
                split,
                data.pack,
                data.val_fraction,
                data.shuffle,
                data.shuffle_block,
            )
        )
        weights.append(weight)
    return datasets[0] if len(datasets) == 1 else BlendedDataset(datasets, weights)
