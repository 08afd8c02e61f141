"""``plait prepare data.path=<corpus> out=<dir or URL>``: tokenize a corpus into fixed-size token
shards plus an index (see :mod:`plait.plugins.data.index`).

    plait prepare data.path=corpus/ out=shards/                          # bytes, no setup
    plait prepare data.path='[a/*.txt,b.jsonl.zst]' out=shards/ data.tokenizer=bpe
    plait prepare data.path=s3://bucket/fineweb/ out=s3://bucket/shards \\
        data.tokenizer=~/models/Qwen2-0.5B launcher=slurm launcher.tasks=64
    plait prepare data.path=HuggingFaceFW/fineweb-edu data.split=train out=shards/  # HF cache

1. **Find and check** every source (:mod:`sources`, :mod:`formats`) in worker processes before
   anything is written: bad input is refused by name, exit 2, no ``out``.
2. **Plan**: the tokenizer (BPE trained on the corpus, a file, a model's own), then pieces (JSON
   lines at lines, parquet at row groups, ``datasets`` at rows, a large text file at cuts the
   tokenizer makes exactly, :mod:`cutting`) grouped into tasks of about ``data.task_mb``,
   saved as ``<out>/work/plan.json``.
3. **Tokenize** each task, then **write** each shard (:mod:`work`), on ``launcher=local``
   (worker processes) or ``launcher=slurm`` (job arrays, :mod:`launchers`).
4. **Index**: ``documents.npy``, then ``index.json`` with every shard's xxh3_64 checksum;
   ``work/`` is removed.

The shards are the documents' tokens in input order, each document encoded whole, so they are
byte-identical for any number of workers, tasks, array tasks or machines. A killed prepare
resumes when run again with the same command (any launcher or worker count): finished units are
never redone. The inputs (paths and sizes with modification times or ETags), the tokenizer, the
text field, split and shard size form a fingerprint; a changed input is refused, not mixed in.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
from omegaconf import MISSING, OmegaConf

from plait.plugins.data import index as fmt
from plait.plugins.data import launchers
from plait.plugins.data import work as units
from plait.plugins.data.cutting import text_cuts
from plait.plugins.data.formats import TEXT, Piece, Source, close_streams, read_documents, scan
from plait.plugins.data.launchers import PrepareLauncherConfig, launcher_problems
from plait.plugins.data.sources import find_sources
from plait.plugins.data.tokenizer import (
    BPE,
    BYTES,
    TOKENIZER_JSON,
    ByteTokenizer,
    load_model_tokenizer,
    load_tokenizer_file,
    train_bpe,
)
from plait.plugins.data.work import PLAN, WORK, Work

MB = 1 << 20
PIECE_BYTES = MB  # a piece: what one encode_batch call holds at most (a large file's cuts)
GUIDED_SHARE = 2  # data.task_mb=null: each task 1/(2 x workers) of the text left, 1-256 MiB
MIN_TASK, MAX_TASK = MB, 256 * MB
PLAN_FORMAT = "plait-prepare-plan-v1"


@dataclass
class PrepareDataConfig:
    path: Any = MISSING  # files, directories, globs, URLs, a datasets directory or HF name
    text_field: str = "text"  # the text of a JSON line, a parquet or datasets row
    split: str = "train"  # a DatasetDict's split, or a cached dataset's
    subset: Optional[str] = None  # a cached dataset's configuration (load_dataset's name)
    # bytes | bpe (trained here) | the path of a tokenizer.json | a model directory (its own)
    tokenizer: str = BYTES
    vocab_size: int = 8192  # data.tokenizer=bpe only
    shard_tokens: int = 2**25  # tokens per shard: 64 MiB of uint16 (Streaming's shard size)
    num_workers: int = 0  # tokenizing processes (per array task); 0: one per CPU core
    task_mb: Optional[float] = None  # MiB of text per task; null: shrinking (guided) tasks


@dataclass
class PrepareConfig:
    defaults: list[Any] = field(default_factory=lambda: ["_self_", {"launcher": "local"}])
    data: PrepareDataConfig = field(default_factory=PrepareDataConfig)
    launcher: PrepareLauncherConfig = field(default_factory=PrepareLauncherConfig)
    out: str = MISSING


# ---------------------------------------------------------------------------------------------
# settings
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
    if data.task_mb is not None and data.task_mb <= 0:
        problems.append(
            f"data.task_mb={data.task_mb} is out of range: set data.task_mb > 0, "
            "or null (tasks sized by the text left)"
        )
    return problems


def tokenizer_spec(data) -> str:
    if data.tokenizer == BYTES:
        return BYTES
    if data.tokenizer == BPE:
        return f"bpe:{data.vocab_size}"
    directory = model_directory(data)
    file = directory / TOKENIZER_JSON if directory else Path(data.tokenizer).expanduser()
    return ("model:" if directory else "file:") + hashlib.sha256(file.read_bytes()).hexdigest()


def fingerprint(sources: list[Source], data) -> str:
    """What the output depends on: the inputs (path and key), how documents are read, the
    tokenizer, the shard size. Not the workers, tasks or launcher: the output does not depend
    on them."""
    digest = hashlib.sha256(
        f"{fmt.FORMAT}\0{tokenizer_spec(data)}\0{data.shard_tokens}\0"
        f"{data.text_field}\0{data.split}\0{data.subset}\n".encode()
    )
    for s in sources:
        digest.update(f"{s.path}\0{s.format}\0{s.key}\n".encode())
    return digest.hexdigest()


def entries(path) -> list:
    return list(path) if OmegaConf.is_list(path) or isinstance(path, (list, tuple)) else [path]


# ---------------------------------------------------------------------------------------------
# the command
# ---------------------------------------------------------------------------------------------


def prepare(data, out, launcher=None, log: Callable = print):
    """Tokenize ``data.path`` into ``out`` (a directory or URL); resume an unfinished prepare of
    the same inputs. Returns ``out``."""
    launcher = launcher if launcher is not None else OmegaConf.structured(PrepareLauncherConfig)
    problems = check_settings(data) + launcher_problems(launcher)
    if problems:
        raise ValueError("; ".join(problems))
    sources = find_sources(entries(data.path), data.split, data.subset)
    print_ = fingerprint(sources, data)
    units.forget()  # a plan or counts an earlier prepare in this process loaded
    work = Work(str(out) if "://" in str(out) else os.path.abspath(out))  # as array tasks see it
    state = existing(work, print_)
    if state == "done":
        log(f"plait prepare: {out} already holds these inputs prepared; nothing to do")
        return out
    workers = data.num_workers or os.cpu_count() or 1
    if state != "planned":
        pieces = scan_all(sources, data, workers)  # refusals: before anything is written
        work.fs.makedirs(work.dir, exist_ok=True)
        work.write_bytes(work.path(PLAN), json.dumps({"fingerprint": print_}).encode())
        tokenizer = build_tokenizer(data, work, sources, pieces)
        slots = (
            workers
            if launcher.name == "local"
            else launcher.tasks * (data.num_workers or launcher.cpus_per_task or workers)
        )  # processes over the array
        plan = make_plan(sources, pieces, tokenizer, data, slots, print_)
        work.write_bytes(work.path(PLAN), json.dumps(plan).encode())
    plan = work.plan
    n_tasks = len(plan["tasks"])
    if state == "planned":
        left = len(units.undone(work, units.TOKENIZE, n_tasks))
        log(f"plait prepare: resuming in {out}: {n_tasks - left}/{n_tasks} tasks already tokenized")
    log(
        f"plait prepare: {len(sources)} source(s), {n_tasks} task(s) of about "
        f"{plan['task_size'] / MB:.3g} MiB, {plan['tokenizer']['name']} tokenizer, "
        f"launcher={launcher.name}"
    )
    workers = workers if launcher.name == "local" else data.num_workers  # 0: the task's cores
    with TokenizingBar(plan["task_bytes"], work, n_tasks, launcher, workers) as bar:
        launchers.run(launcher, work, units.TOKENIZE, n_tasks, workers, log, bar)
    n_shards = write_counts(work, plan)
    launchers.run(launcher, work, units.WRITE_SHARDS, n_shards, workers, log)
    finish(work, plan, n_shards)
    log(
        f"plait prepare: {n_shards} shards, {plan['tokenizer']['name']} tokenizer (vocab "
        f"{plan['tokenizer']['vocab_size']}) in {out}"
    )
    return out


def existing(work: Work, print_: str) -> str:
    """``new``, ``started`` (before its plan), ``planned`` or ``done``; refuses an ``out``
    holding something else."""
    fs = work.fs
    names = (
        {e.rstrip("/").rsplit("/", 1)[-1] for e in fs.ls(work.root, detail=False)}
        if fs.exists(work.root)
        else set()
    )
    if fmt.INDEX in names:
        if json.loads(fs.cat_file(work.out_path(fmt.INDEX))).get("fingerprint") == print_:
            return "done"
        raise ValueError(
            f"out={work.out} already holds shards of other inputs or settings: "
            "choose another out= directory, or delete it"
        )
    if WORK in names:
        plan = json.loads(fs.cat_file(work.path(PLAN))) if fs.exists(work.path(PLAN)) else {}
        if plan.get("fingerprint", print_) != print_:
            raise ValueError(
                f"out={work.out} holds an unfinished prepare of other inputs or "
                "settings: run that prepare again, or choose another out="
            )
        return "planned" if "tasks" in plan else "started"
    if names:
        raise ValueError(f"out={work.out} is not empty: choose a new directory for the shards")
    return "new"


# ---------------------------------------------------------------------------------------------
# 1. the scan, 2. the plan
# ---------------------------------------------------------------------------------------------


def piece_bytes(data) -> int:
    return min(PIECE_BYTES, int(data.task_mb * MB)) if data.task_mb else PIECE_BYTES


def scan_all(sources: list[Source], data, workers: int) -> list[list[Piece]]:
    """Each source's pieces, scanned in ``workers`` processes; the first refusal raised."""
    scan_one = partial(
        scan,
        text_field=data.text_field,
        piece_bytes=piece_bytes(data),
        split=data.split,
        subset=data.subset,
    )
    if workers <= 1 or len(sources) == 1:
        return [scan_one(s) for s in sources]
    with multiprocessing.get_context("fork").Pool(
        min(workers, len(sources)), units._init_worker
    ) as pool:
        return pool.map(scan_one, sources, chunksize=max(1, len(sources) // (8 * workers)))


def make_plan(
    sources: list[Source], pieces: list[list[Piece]], tokenizer, data, slots: int, print_: str
) -> dict:
    """Tasks of about ``data.task_mb`` (or shrinking, :func:`next_task_size`); a large plain
    text file is cut where the tokenizer cuts exactly, its pieces kept apart (one encode call
    each)."""
    cut: list[Piece] = []
    for i, (source, found) in enumerate(zip(sources, pieces)):
        if source.format == TEXT and source.cuttable and found:
            bounds = [
                0,
                *text_cuts(reader(source.path), source.size, piece_bytes(data), tokenizer),
                source.size,
            ]
            cut += [Piece(i, a, b, b - a) for a, b in zip(bounds, bounds[1:])]
        else:
            cut += [Piece(i, p.start, p.end, p.text_bytes) for p in found]
    total = sum(p.text_bytes for p in cut)
    tasks, task_bytes, current, size, left = [], [], [], 0, total
    task_size = next_task_size(data, left, slots)
    for p in cut:
        joined = (
            current
            and current[-1][0] == p.source
            and current[-1][2] == p.start
            and sources[p.source].format != TEXT
        )
        if joined:
            current[-1][2] = p.end
        else:
            current.append([p.source, p.start, p.end])
        size += p.text_bytes
        if size >= task_size:
            tasks.append(current)
            task_bytes.append(size)
            left -= size
            current, size = [], 0
            task_size = next_task_size(data, left, slots)
    if current:
        tasks.append(current)
        task_bytes.append(size)
    return {
        "format": PLAN_FORMAT,
        "fingerprint": print_,
        "sources": [vars(s) for s in sources],
        "text_field": data.text_field,
        "split": data.split,
        "subset": data.subset,
        "tokenizer": {
            "name": tokenizer.name,
            "identity": tokenizer.identity,
            "vocab_size": tokenizer.vocab_size,
            "eot": tokenizer.eot,
        },
        "dtype": fmt.token_dtype(tokenizer.vocab_size),
        "shard_tokens": data.shard_tokens,
        "task_size": total // max(len(tasks), 1),  # the mean, for the log
        "tasks": tasks,
        "task_bytes": task_bytes,
    }


def next_task_size(data, left: int, slots: int) -> int:
    """``data.task_mb``, or (null) a share of the text ``left`` to plan: guided scheduling
    (OpenMP's ``schedule(guided)``) -- large tasks first, then smaller ones, so that the
    ``slots`` processes, taking tasks in order as they free up, finish together (tasks of one
    size leave a process idle for up to a whole task at the end: 4 tasks against 3 is a 9%
    longer run)."""
    if data.task_mb:
        return int(data.task_mb * MB)
    return min(max(left // (GUIDED_SHARE * slots), MIN_TASK), MAX_TASK)


def reader(path: str) -> Callable[[int, int], bytes]:
    from fsspec.core import url_to_fs

    fs, inner = url_to_fs(path)

    def read(offset: int, n: int) -> bytes:
        with fs.open(inner, "rb") as f:
            f.seek(offset)
            return f.read(n)

    return read


def build_tokenizer(data, work: Work, sources: list[Source], pieces: list[list[Piece]]):
    """Bytes; the tokenizer saved in ``out`` by an earlier attempt; a given file; a model
    directory's own; or BPE trained on the whole input (saved in ``out`` before tokenizing, so a
    resume reuses it)."""
    if data.tokenizer == BYTES:
        return ByteTokenizer()
    saved = work.out_path(fmt.TOKENIZER)
    directory = model_directory(data)
    if directory is not None:
        tokenizer = load_model_tokenizer(directory)
    elif work.fs.exists(saved):
        from plait.plugins.data.tokenizer import HFTokenizer

        return HFTokenizer.from_json(
            work.fs.cat_file(saved).decode(), BPE if data.tokenizer == BPE else "file"
        )
    elif data.tokenizer == BPE:
        documents = (
            text
            for source, found in zip(sources, pieces)
            for p in found
            for text, _, _ in read_documents(
                source, p.start, p.end, data.text_field, data.split, data.subset
            )
        )
        tokenizer = train_bpe(documents, data.vocab_size)
        close_streams()  # a compressed file's stream, kept open for a next piece
    else:
        tokenizer = load_tokenizer_file(Path(data.tokenizer).expanduser(), "file")
    work.write_bytes(saved, tokenizer.json.encode())
    return tokenizer


# ---------------------------------------------------------------------------------------------
# 3. between the phases, 4. the index
# ---------------------------------------------------------------------------------------------


def write_counts(work: Work, plan: dict) -> int:
    """Tokens per task (from the sizes of their files, one listing) for the shard writers;
    the number of shards."""
    names = work.listing()
    itemsize = np.dtype(plan["dtype"]).itemsize
    counts = [names[units.task_name(t, "tokens")] // itemsize for t in range(len(plan["tasks"]))]
    total = sum(counts)
    if total == 0:
        raise ValueError("data.path holds no text: give non-empty files")
    work.write_bytes(work.path(units.COUNTS), json.dumps({"tokens": counts}).encode())
    return -(-total // plan["shard_tokens"])


def finish(work: Work, plan: dict, n_shards: int) -> None:
    """``documents.npy`` (streamed from the tasks' document ends), ``index.json`` last, then
    ``work/`` removed."""
    names = work.listing()
    offsets = units.task_offsets(work)
    n_tasks = len(plan["tasks"])
    n_docs = sum(names[units.task_name(t, "ends")] // 8 for t in range(n_tasks))
    with work.output(work.out_path(fmt.DOCUMENTS)) as f:
        np.lib.format.write_array_header_1_0(
            f, {"descr": "<i8", "fortran_order": False, "shape": (n_docs + 1,)}
        )
        f.write(np.zeros(1, dtype="<i8").tobytes())
        for t in range(n_tasks):
            ends = np.frombuffer(
                work.fs.cat_file(work.path(units.task_name(t, "ends"))), dtype="<i8"
            )
            f.write((ends + offsets[t]).astype("<i8").tobytes())
    total, shard_tokens = int(offsets[-1]), plan["shard_tokens"]
    shards = []
    for k in range(n_shards):
        checksum = work.fs.cat_file(work.path(f"{fmt.shard_name(k)}.xxh3_64")).decode()
        shards.append(
            {
                "file": fmt.shard_name(k),
                "tokens": min(shard_tokens, total - k * shard_tokens),
                fmt.CHECKSUM: checksum,
            }
        )
    meta = {
        "format": fmt.FORMAT,
        "fingerprint": plan["fingerprint"],
        "tokenizer": plan["tokenizer"],
        "dtype": plan["dtype"],
        "shard_tokens": shard_tokens,
        "documents": n_docs,
        "tokens": total,
        "shards": shards,
    }
    work.write_bytes(work.out_path(fmt.INDEX), json.dumps(meta, indent=1).encode())
    work.fs.rm(work.dir, recursive=True)
    if work.local:  # a shard's temporary file, left by a writer killed mid-way
        for leftover in Path(work.root).glob(".shard_*.tmp"):
            leftover.unlink(missing_ok=True)


class TokenizingBar:
    """A tqdm bar of the text tokenized on this machine (``launcher=local``); nothing for an
    array, whose tasks report to SLURM."""

    def __init__(self, task_bytes: list[int], work: Work, n_tasks: int, launcher, workers: int):
        self.bar = None
        if launcher.name == "local":
            from tqdm import tqdm

            pending = set(units.undone(work, units.TOKENIZE, n_tasks))
            done = sum(b for t, b in enumerate(task_bytes) if t not in pending)
            self.bar = tqdm(
                total=sum(task_bytes),
                initial=done,
                unit="B",
                unit_scale=True,
                desc=f"tokenizing ({workers} workers)",
            )

    def __call__(self, nbytes: int) -> None:
        self.bar.update(nbytes)

    def __enter__(self):
        return self if self.bar is not None else None

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.close()


# ---------------------------------------------------------------------------------------------
# the command line
# ---------------------------------------------------------------------------------------------

CONF = Path(__file__).parent / "prepare_conf"  # the launcher group: local.yaml, slurm.yaml


def compose_prepare(overrides: list[str]):
    """The prepare config from the user's overrides (Hydra's Compose API)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="plait_prepare", node=PrepareConfig)
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF)):
        cfg = compose(config_name="plait_prepare", overrides=list(overrides))
    for key in ("data.path", "out"):
        if OmegaConf.is_missing(cfg, key):
            raise ValueError(
                f"plait prepare needs {key}=...: e.g. plait prepare data.path=corpus/ out=shards/"
            )
    return cfg


def cmd_prepare(overrides: list[str]) -> int:
    cfg = compose_prepare(overrides)
    out = cfg.out if "://" in cfg.out else os.path.expanduser(cfg.out)
    prepare(cfg.data, out, cfg.launcher)
    return 0
