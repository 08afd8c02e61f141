"""``plait prepare data.path=<files, dirs or globs> out=<dir>``: tokenize a text corpus into
fixed-size token shards plus an index (see :mod:`plait.plugins.data.index`).

    plait prepare data.path=corpus/ out=shards/                          # bytes, no setup
    plait prepare data.path='[a/*.txt,b.jsonl]' out=shards/ data.tokenizer=bpe data.vocab_size=8192
    plait prepare data.path=more/ out=shards2/ data.tokenizer=shards/tokenizer.json
    plait prepare data.path=corpus/ out=shards/ data.tokenizer=~/models/Qwen2-0.5B  # the model's

A ``.jsonl`` file holds one document per line (its ``"text"``); any other file is one document.
The input is cut into ~1 MiB tasks that worker processes tokenize in parallel; the results are
written in task order, so the shards do not depend on the number of workers. After every task
that completes a shard, the progress (tasks done, shards written, the tokens of the unfinished
shard, document lengths) is saved atomically, so a killed prepare resumes where it stopped when
run again with the same command.
"""

from __future__ import annotations

import glob
import hashlib
import json
import multiprocessing
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
from omegaconf import MISSING, OmegaConf

from plait.plugins.data import index as fmt
from plait.plugins.data.tokenizer import (
    BPE,
    BYTES,
    TOKENIZER_JSON,
    ByteTokenizer,
    from_spec,
    load_model_tokenizer,
    load_tokenizer_file,
    train_bpe,
)

CHUNK_BYTES = 1 << 20  # input bytes per tokenization task
PROGRESS = "progress.npz"
DOC_LENGTHS = "documents.partial"  # int64 lengths, appended; cut back to the saved count on resume


@dataclass
class PrepareDataConfig:
    path: Any = MISSING  # a file, a directory, a glob, or a list of them
    # bytes | bpe (trained here) | the path of a tokenizer.json | a model directory (its own)
    tokenizer: str = BYTES
    vocab_size: int = 8192  # data.tokenizer=bpe only
    shard_tokens: int = 2**25  # tokens per shard: 64 MiB of uint16 (Streaming's shard size)
    num_workers: int = 0  # tokenizing processes; 0: one per CPU core


@dataclass
class PrepareConfig:
    data: PrepareDataConfig = field(default_factory=PrepareDataConfig)
    out: str = MISSING


@dataclass(frozen=True)
class Segment:
    """Bytes ``[start, end)`` of one file: one document, or lines of a ``.jsonl`` file."""

    path: str
    start: int
    end: int
    jsonl: bool


# ---------------------------------------------------------------------------------------------
# the inputs
# ---------------------------------------------------------------------------------------------


def find_sources(paths: list[str]) -> list[Path]:
    """Files named by each entry (a file, a directory searched recursively, or a glob), sorted
    within an entry, in the order of the entries, each once."""
    found: list[Path] = []
    for entry in paths:
        entry = os.path.expanduser(str(entry))
        if glob.has_magic(entry):
            matches = [Path(p) for p in sorted(glob.glob(entry, recursive=True))]
        else:
            matches = [Path(entry)]
        files = []
        for p in matches:
            if p.is_dir():
                files += sorted(
                    f
                    for f in p.rglob("*")
                    if f.is_file()
                    and not any(part.startswith(".") for part in f.relative_to(p).parts)
                )
            elif p.is_file():
                files.append(p)
        if not files:
            raise ValueError(
                f"data.path entry {entry} matches no file: give text files, directories or globs"
            )
        found += [f for f in files if f not in found]
    return found


def plan_tasks(files: list[Path]) -> list[list[Segment]]:
    """Cut the input into tasks of about ``CHUNK_BYTES``; a ``.jsonl`` file is cut at lines."""
    tasks, current, size = [], [], 0
    for path in files:
        total = path.stat().st_size
        if total == 0:
            continue
        if path.suffix != ".jsonl":
            pieces = [(0, total)]
        else:
            pieces, start = [], 0
            with open(path, "rb") as f:
                while start < total:
                    f.seek(min(start + CHUNK_BYTES, total))
                    f.readline()
                    end = min(f.tell(), total)
                    pieces.append((start, end))
                    start = end
        for start, end in pieces:
            current.append(Segment(str(path), start, end, path.suffix == ".jsonl"))
            size += end - start
            if size >= CHUNK_BYTES:
                tasks.append(current)
                current, size = [], 0
    return tasks + ([current] if current else [])


def read_documents(segments: list[Segment]) -> list[bytes]:
    docs = []
    for seg in segments:
        with open(seg.path, "rb") as f:
            f.seek(seg.start)
            data = f.read(seg.end - seg.start)
        if seg.jsonl:
            docs += [
                json.loads(line)["text"].encode() for line in data.splitlines() if line.strip()
            ]
        else:
            docs.append(data)
    return [d for d in docs if d]


def fingerprint(files: list[Path], tokenizer_spec: str, shard_tokens: int) -> str:
    """What the output depends on: the inputs (path, size, mtime), the tokenizer, the shard
    size."""
    digest = hashlib.sha256(f"{fmt.FORMAT}\0{tokenizer_spec}\0{shard_tokens}\n".encode())
    for p in files:
        st = p.stat()
        digest.update(f"{p.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()


# ---------------------------------------------------------------------------------------------
# tokenizing in worker processes
# ---------------------------------------------------------------------------------------------

_worker: dict[str, Any] = {}


def _init_worker(
    name: str, tokenizer_json: Optional[str], dtype: str, eot: Optional[int] = None
) -> None:
    # A forked worker inherits the parent's signal dispositions (torch elastic installs Python
    # handlers in a process that has launched workers, as the test process has); with the
    # default, the pool's terminate() on an error ends a worker whatever it is doing.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker process
    _worker.update(tokenizer=from_spec(name, tokenizer_json, eot), dtype=dtype)


def tokenize_task(segments: list[Segment]) -> tuple[np.ndarray, np.ndarray, int]:
    """Tokens of a task's documents (each followed by the tokenizer's end-of-text, if it has
    one), the length of each document, and the input bytes read."""
    tokenizer = _worker["tokenizer"]
    encoded = tokenizer.encode_batch(read_documents(segments))
    if tokenizer.eot is not None:
        encoded = [np.append(ids, tokenizer.eot) for ids in encoded]
    lengths = np.array([len(ids) for ids in encoded], dtype=np.int64)
    tokens = np.concatenate(encoded) if encoded else np.zeros(0, dtype=np.int64)
    return tokens.astype(_worker["dtype"]), lengths, sum(s.end - s.start for s in segments)


# ---------------------------------------------------------------------------------------------
# writing shards, with progress saved for a resume
# ---------------------------------------------------------------------------------------------


@dataclass
class Progress:
    fingerprint: str
    tasks_done: int = 0
    shards_done: int = 0
    n_docs: int = 0
    bytes_done: int = 0
    carry: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    def save(self, out: Path) -> None:
        tmp = out / f".{PROGRESS}.tmp"
        with open(tmp, "wb") as f:
            np.savez(
                f,
                fingerprint=self.fingerprint,
                carry=self.carry,
                counters=np.array(
                    [self.tasks_done, self.shards_done, self.n_docs, self.bytes_done],
                    dtype=np.int64,
                ),
            )
        os.replace(tmp, out / PROGRESS)

    @classmethod
    def load(cls, out: Path) -> Progress:
        with np.load(out / PROGRESS) as saved:
            tasks, shards, docs, done = (int(c) for c in saved["counters"])
            return cls(str(saved["fingerprint"]), tasks, shards, docs, done, saved["carry"])


class ShardWriter:
    """Cuts the token stream into shards of exactly ``shard_tokens`` tokens."""

    def __init__(self, out: Path, dtype: str, shard_tokens: int, progress: Progress):
        self.out, self.dtype, self.shard_tokens, self.progress = out, dtype, shard_tokens, progress
        self.buffer = [progress.carry.astype(dtype)]
        self.buffered = len(progress.carry)
        with open(out / DOC_LENGTHS, "ab") as f:  # drop lengths written after the last save
            f.truncate(progress.n_docs * 8)

    def add(self, tokens: np.ndarray, lengths: np.ndarray, nbytes: int) -> None:
        self.buffer.append(tokens)
        self.buffered += len(tokens)
        with open(self.out / DOC_LENGTHS, "ab") as f:
            f.write(lengths.tobytes())
        p = self.progress
        p.tasks_done, p.n_docs, p.bytes_done = (
            p.tasks_done + 1,
            p.n_docs + len(lengths),
            p.bytes_done + nbytes,
        )
        if self.buffered < self.shard_tokens:
            return
        stream = np.concatenate(self.buffer)
        cut = 0
        while len(stream) - cut >= self.shard_tokens:
            fmt.write_shard(
                self.out / fmt.shard_name(p.shards_done),
                stream[cut : cut + self.shard_tokens],
                self.dtype,
            )
            cut += self.shard_tokens
            p.shards_done += 1
        p.carry = stream[cut:]
        self.buffer, self.buffered = [p.carry], len(p.carry)
        p.save(self.out)

    def finish(self, tokenizer) -> int:
        """Write the last, shorter shard, the document offsets and the index; return the shard
        count."""
        p = self.progress
        rest = np.concatenate(self.buffer)
        if len(rest):
            fmt.write_shard(self.out / fmt.shard_name(p.shards_done), rest, self.dtype)
            p.shards_done += 1
        lengths = np.fromfile(self.out / DOC_LENGTHS, dtype=np.int64)
        total = int(lengths.sum())
        if total == 0:
            raise ValueError("data.path holds no text: give non-empty files")
        with open(self.out / f".{fmt.DOCUMENTS}.tmp", "wb") as f:
            np.save(f, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
        os.replace(self.out / f".{fmt.DOCUMENTS}.tmp", self.out / fmt.DOCUMENTS)
        sizes = [self.shard_tokens] * (p.shards_done - 1) + [
            total - self.shard_tokens * (p.shards_done - 1)
        ]
        meta = {
            "format": fmt.FORMAT,
            "fingerprint": p.fingerprint,
            "tokenizer": {
                "name": tokenizer.name,
                "identity": tokenizer.identity,
                "vocab_size": tokenizer.vocab_size,
                "eot": tokenizer.eot,
            },
            "dtype": self.dtype,
            "shard_tokens": self.shard_tokens,
            "documents": len(lengths),
            "tokens": total,
            "shards": [{"file": fmt.shard_name(k), "tokens": n} for k, n in enumerate(sizes)],
        }
        fmt.atomic_write_bytes(self.out / fmt.INDEX, json.dumps(meta, indent=1).encode())
        (self.out / PROGRESS).unlink()
        (self.out / DOC_LENGTHS).unlink()
        return p.shards_done


# ---------------------------------------------------------------------------------------------
# the command
# ---------------------------------------------------------------------------------------------


def model_directory(data) -> Optional[Path]:
    """``data.tokenizer`` when it names a directory (a model's)."""
    if data.tokenizer in (BYTES, BPE):
        return None
    path = Path(data.tokenizer).expanduser()
    return path if path.is_dir() else None


def check_settings(data) -> list[str]:
    problems = []
    directory = model_directory(data)
    if directory is not None and not (directory / TOKENIZER_JSON).is_file():
        problems.append(
            f"data.tokenizer={data.tokenizer} is a directory without "
            f"{TOKENIZER_JSON}: give a model directory that has one (a tokenizer "
            "saved by transformers' save_pretrained), or a tokenizer.json file"
        )
    elif (
        directory is None
        and data.tokenizer not in (BYTES, BPE)
        and not Path(data.tokenizer).expanduser().is_file()
    ):
        problems.append(
            f"data.tokenizer={data.tokenizer}: choose bytes, bpe, the path of an "
            "existing tokenizer.json, or a model directory holding one"
        )
    if data.tokenizer == BPE and not 257 <= data.vocab_size <= 2**32:
        problems.append(
            f"data.vocab_size={data.vocab_size} cannot hold byte-level BPE: give at "
            "least 257 (256 bytes and <|endoftext|>)"
        )
    if data.shard_tokens < 1:
        problems.append(f"data.shard_tokens={data.shard_tokens} must be at least 1")
    if data.num_workers < 0:
        problems.append(f"data.num_workers={data.num_workers}: give 0 (one per core) or more")
    return problems


def tokenizer_spec(data) -> str:
    if data.tokenizer == BYTES:
        return BYTES
    if data.tokenizer == BPE:
        return f"bpe:{data.vocab_size}"
    directory = model_directory(data)
    file = directory / TOKENIZER_JSON if directory else Path(data.tokenizer).expanduser()
    return ("model:" if directory else "file:") + hashlib.sha256(file.read_bytes()).hexdigest()


def prepare(data, out: Path, log=print) -> Path:
    """Tokenize ``data.path`` into ``out``; resume an unfinished prepare of the same inputs."""
    problems = check_settings(data)
    if problems:
        raise ValueError("; ".join(problems))
    paths = (
        list(data.path)
        if OmegaConf.is_list(data.path) or isinstance(data.path, list)
        else [data.path]
    )
    files = find_sources(paths)
    tasks = plan_tasks(files)
    print_ = fingerprint(files, tokenizer_spec(data), data.shard_tokens)
    if (out / fmt.INDEX).exists():
        if json.loads((out / fmt.INDEX).read_text()).get("fingerprint") == print_:
            log(f"plait prepare: {out} already holds these inputs prepared; nothing to do")
            return out
        raise ValueError(
            f"out={out} already holds shards of other inputs or settings: choose "
            "another out= directory, or delete it"
        )
    if (out / PROGRESS).exists():
        progress = Progress.load(out)
        if progress.fingerprint != print_:
            raise ValueError(
                f"out={out} holds an unfinished prepare of other inputs or "
                "settings: run that prepare again, or choose another out="
            )
        log(
            f"plait prepare: resuming in {out} at task {progress.tasks_done}/{len(tasks)} "
            f"({progress.shards_done} shards written)"
        )
    elif out.exists() and any(out.iterdir()):
        raise ValueError(f"out={out} is not empty: choose a new directory for the shards")
    else:
        out.mkdir(parents=True, exist_ok=True)
        progress = Progress(print_)
        progress.save(out)

    tokenizer = build_tokenizer(data, out, tasks)
    dtype = fmt.token_dtype(tokenizer.vocab_size)
    writer = ShardWriter(out, dtype, data.shard_tokens, progress)
    workers = data.num_workers or os.cpu_count() or 1
    from tqdm import tqdm

    total_bytes = sum(s.end - s.start for task in tasks for s in task)
    bar = tqdm(
        total=total_bytes,
        initial=progress.bytes_done,
        unit="B",
        unit_scale=True,
        desc=f"tokenizing ({workers} workers)",
    )
    # fork: workers start at once with the modules loaded (spawn would import torch in each);
    # HF tokenizers disables its thread pool in forked children, and _init_worker says so too
    context = multiprocessing.get_context("fork")
    with context.Pool(
        workers, _init_worker, (tokenizer.name, tokenizer.json, dtype, tokenizer.eot)
    ) as pool:
        for tokens, lengths, nbytes in pool.imap(tokenize_task, tasks[progress.tasks_done :]):
            writer.add(tokens, lengths, nbytes)
            bar.update(nbytes)
        pool.close()  # workers leave on their own; the with-block's terminate is for errors
        pool.join()
    bar.close()
    shards = writer.finish(tokenizer)
    log(
        f"plait prepare: {shards} shards, {tokenizer.name} tokenizer (vocab "
        f"{tokenizer.vocab_size}) in {out}"
    )
    return out


def build_tokenizer(data, out: Path, tasks: list[list[Segment]]):
    """Bytes; the tokenizer saved in ``out`` by an earlier attempt; a given file; a model
    directory's own; or BPE trained on the whole input (saved in ``out`` before tokenizing, so a
    resume reuses it)."""
    if data.tokenizer == BYTES:
        return ByteTokenizer()
    directory = model_directory(data)
    if directory is not None:
        tokenizer = load_model_tokenizer(directory)
        fmt.atomic_write_bytes(out / fmt.TOKENIZER, tokenizer.json.encode())
        return tokenizer
    saved = out / fmt.TOKENIZER
    name = BPE if data.tokenizer == BPE else "file"
    if saved.exists():
        return load_tokenizer_file(saved, name)
    if data.tokenizer == BPE:
        tokenizer = train_bpe(
            (doc for task in tasks for doc in read_documents(task)), data.vocab_size
        )
    else:
        tokenizer = load_tokenizer_file(Path(data.tokenizer).expanduser(), name)
    fmt.atomic_write_bytes(saved, tokenizer.json.encode())
    return tokenizer


def compose_prepare(overrides: list[str]):
    """The prepare config from the user's overrides (Hydra's Compose API)."""
    from hydra import compose, initialize
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="plait_prepare", node=PrepareConfig)
    with initialize(version_base="1.3", config_path=None):
        cfg = compose(config_name="plait_prepare", overrides=list(overrides))
    for key in ("data.path", "out"):
        if OmegaConf.is_missing(cfg, key):
            raise ValueError(
                f"plait prepare needs {key}=...: e.g. plait prepare data.path=corpus/ out=shards/"
            )
    return cfg


def cmd_prepare(overrides: list[str]) -> int:
    cfg = compose_prepare(overrides)
    prepare(cfg.data, Path(cfg.out).expanduser())
    return 0
