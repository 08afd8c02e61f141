"""The units of work of ``plait prepare``, run wherever the launcher puts them (worker processes
on this machine, the tasks of a SLURM job array), each on its own and idempotent: a unit that
finished left a marker and is never redone; one that was killed left no marker and is run
again from its start, overwriting what it had begun. Everything lives in ``<out>/work/``, on any
file system fsspec opens (a shared directory, or object storage) and is removed at the end.

1. **tokenize task** ``t``: the documents of the task's pieces (see :mod:`formats`), encoded in
   batches of about ``BATCH_BYTES`` of text, written to ``task_<t>.tokens`` (the token dtype,
   no header) and ``task_<t>.ends`` (int64: where each document ends, counted in the task's
   tokens); marker ``task_<t>.done``.
2. **write shard** ``k``: tokens ``[k*S, (k+1)*S)`` of the tasks' tokens concatenated in task
   order, with llm.c's header, to ``<out>/shard_<k>.bin``, hashed (xxh3_64) as they are copied;
   marker ``shard_<k>.xxh3_64`` holding the checksum.

A local file is written under a temporary name and renamed, so two runs of one unit (a SLURM
requeue) never interleave; an object store replaces an object whole on its own.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
from contextlib import contextmanager
from functools import partial
from typing import Any, Callable, Iterator, Optional

import numpy as np

from plait.plugins.data import index as fmt
from plait.plugins.data.formats import Source, close_streams, read_documents

WORK = "work"
PLAN = "plan.json"
COUNTS = "counts.json"  # tokens per task, written between the two phases
BATCH_BYTES = 1 << 20  # text per encode_batch call
COPY_BYTES = 1 << 23
TOKENIZE, WRITE_SHARDS = "tokenize", "shards"


def task_name(t: int, suffix: str) -> str:
    return f"task_{t:06d}.{suffix}"


class Work:
    """``<out>/work/`` of one prepare, opened in any process."""

    def __init__(self, out: str):
        from fsspec.core import url_to_fs
        from fsspec.implementations.local import LocalFileSystem

        self.out = str(out)
        self.fs, self.root = url_to_fs(self.out)
        self.dir = fmt.join(self.root, WORK)
        self.local = isinstance(self.fs, LocalFileSystem)
        self._plan: Optional[dict] = None

    def path(self, name: str) -> str:
        return fmt.join(self.dir, name)

    def out_path(self, name: str) -> str:
        return fmt.join(self.root, name)

    @property
    def plan(self) -> dict:
        if self._plan is None:
            self._plan = json.loads(self.fs.cat_file(self.path(PLAN)))
        return self._plan

    def listing(self) -> dict[str, int]:
        """File names in ``work/`` and their sizes (one listing, also of object storage)."""
        self.fs.invalidate_cache(self.dir)
        if not self.fs.exists(self.dir):
            return {}
        return {
            e["name"].rstrip("/").rsplit("/", 1)[-1]: int(e.get("size") or 0)
            for e in self.fs.ls(self.dir, detail=True)
        }

    def write_bytes(self, path: str, data: bytes) -> None:
        with self.output(path) as f:
            f.write(data)

    @contextmanager
    def output(self, path: str) -> Iterator[Any]:
        """A file opened for writing that appears at ``path`` only once complete."""
        if not self.local:
            with self.fs.open(path, "wb") as f:
                yield f
            return
        directory, name = os.path.split(path)
        tmp = os.path.join(directory, f".{name}.{os.uname().nodename}.{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as f:
                yield f
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)


# ---------------------------------------------------------------------------------------------
# what a worker process keeps: the plan, the tokenizer, the sources
# ---------------------------------------------------------------------------------------------

_loaded: dict[str, tuple[Work, Any, list[Source]]] = {}


def forget() -> None:
    """Drop what this process loaded: a new prepare (or a forked worker) starts afresh."""
    _loaded.clear()
    _counts.clear()
    close_streams()


def loaded(out: str) -> tuple[Work, Any, list[Source]]:
    if out not in _loaded:
        from plait.plugins.data.tokenizer import from_spec

        work = Work(out)
        plan = work.plan
        spec = plan["tokenizer"]
        json_text = (
            None
            if spec["name"] == "bytes"
            else work.fs.cat_file(work.out_path(fmt.TOKENIZER)).decode()
        )
        tokenizer = from_spec(spec["name"], json_text, spec["eot"])
        _loaded[out] = (work, tokenizer, [Source(**s) for s in plan["sources"]])
    return _loaded[out]


# ---------------------------------------------------------------------------------------------
# 1. tokenize a task
# ---------------------------------------------------------------------------------------------


def task_documents(plan: dict, sources: list[Source], t: int) -> Iterator[tuple]:
    for source_index, start, end in plan["tasks"][t]:
        yield from read_documents(
            sources[source_index], start, end, plan["text_field"], plan["split"], plan["subset"]
        )


def batches(documents: Iterator[tuple], batch_bytes: int) -> Iterator[list[tuple]]:
    batch, size = [], 0
    for doc in documents:
        batch.append(doc)
        size += len(doc[0])
        if size >= batch_bytes:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def tokenize_task(out: str, t: int) -> int:
    """Tokenize task ``t`` into ``work/``; the text bytes it covered (for progress)."""
    work, tokenizer, sources = loaded(out)
    plan = work.plan
    dtype = np.dtype(plan["dtype"])
    with (
        work.output(work.path(task_name(t, "tokens"))) as tokens_file,
        work.output(work.path(task_name(t, "ends"))) as ends_file,
    ):
        written = 0
        for batch in batches(task_documents(plan, sources, t), BATCH_BYTES):
            encoded = tokenizer.encode_documents(batch)
            lengths = np.array([len(ids) for ids in encoded], dtype=np.int64)
            ends = written + np.cumsum(lengths)
            is_end = np.array(
                [last and not (first and n == 0) for (_, first, last), n in zip(batch, lengths)],
                dtype=bool,
            )
            tokens_file.write(np.concatenate(encoded).astype(dtype).tobytes())
            ends_file.write(ends[is_end].astype(np.int64).tobytes())
            written = int(ends[-1])
    work.write_bytes(work.path(task_name(t, "done")), b"")
    return plan["task_bytes"][t]


# ---------------------------------------------------------------------------------------------
# 2. write a shard
# ---------------------------------------------------------------------------------------------

_counts: dict[str, np.ndarray] = {}


def task_offsets(work: Work) -> np.ndarray:
    """Where each task's tokens start in the stream, and the total at the end."""
    if work.out not in _counts:
        counts = json.loads(work.fs.cat_file(work.path(COUNTS)))["tokens"]
        _counts[work.out] = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
    return _counts[work.out]


def write_shard(out: str, k: int) -> int:
    """Write shard ``k`` and its checksum marker; the tokens it holds."""
    import xxhash

    work = loaded(out)[0]
    plan = work.plan
    offsets = task_offsets(work)
    shard_tokens, itemsize = plan["shard_tokens"], np.dtype(plan["dtype"]).itemsize
    start, stop = k * shard_tokens, min((k + 1) * shard_tokens, int(offsets[-1]))
    digest = xxhash.xxh3_64()
    with work.output(work.out_path(fmt.shard_name(k))) as f:
        header = fmt.shard_header(stop - start, plan["dtype"])
        f.write(header)
        digest.update(header)
        first = int(np.searchsorted(offsets, start, side="right")) - 1
        for t in range(first, len(offsets) - 1):
            a, b = max(start, offsets[t]) - offsets[t], min(stop, offsets[t + 1]) - offsets[t]
            if b > a:
                copy_range(
                    work,
                    work.path(task_name(t, "tokens")),
                    a * itemsize,
                    (b - a) * itemsize,
                    f,
                    digest,
                )
            if offsets[t + 1] >= stop:
                break
    work.write_bytes(work.path(f"{fmt.shard_name(k)}.xxh3_64"), digest.hexdigest().encode())
    return stop - start


def copy_range(work: Work, path: str, offset: int, nbytes: int, dst, digest) -> None:
    with work.fs.open(path, "rb") as src:
        src.seek(offset)
        while nbytes > 0:
            chunk = src.read(min(nbytes, COPY_BYTES))
            if not chunk:
                raise ValueError(
                    f"{path} ends {nbytes} bytes early: its task was cut short; "
                    "delete it and its .done marker, then run prepare again"
                )
            dst.write(chunk)
            digest.update(chunk)
            nbytes -= len(chunk)


# ---------------------------------------------------------------------------------------------
# running units: in this process, or a pool of worker processes
# ---------------------------------------------------------------------------------------------

UNITS: dict[str, Callable[[str, int], int]] = {TOKENIZE: tokenize_task, WRITE_SHARDS: write_shard}


def _init_worker() -> None:
    # A forked worker inherits the parent's signal dispositions (torch elastic installs Python
    # handlers in a process that has launched workers, as the test process has); with the
    # default, the pool's terminate() on an error ends a worker whatever it is doing.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker process
    forget()  # the parent's file systems: an async one (s3fs) is not fork-safe


def run_units(
    out: str,
    phase: str,
    ids: list[int],
    workers: int,
    progress: Optional[Callable[[int], None]] = None,
) -> None:
    """Run the units ``ids`` of ``phase`` with ``workers`` processes (1: in this process; 0: one
    per core this process may use). The entry point of a SLURM array task too."""
    function = partial(UNITS[phase], str(out))
    workers = min(workers or len(os.sched_getaffinity(0)), len(ids))
    if workers <= 1:
        try:
            for i in ids:
                done = function(i)
                if progress:
                    progress(done)
        finally:
            close_streams()
        return
    # fork: workers start at once with the modules loaded (spawn would import torch in each);
    # HF tokenizers disables its thread pool in forked children, and _init_worker says so too
    with multiprocessing.get_context("fork").Pool(workers, _init_worker) as pool:
        for done in pool.imap_unordered(function, ids):
            if progress:
                progress(done)
        pool.close()  # workers leave on their own; the with-block's terminate is for errors
        pool.join()


def undone(work: Work, phase: str, count: int) -> list[int]:
    """The units of ``phase`` (``count`` of them) without a marker."""
    names = work.listing()
    if phase == TOKENIZE:
        return [t for t in range(count) if task_name(t, "done") not in names]
    return [k for k in range(count) if f"{fmt.shard_name(k)}.xxh3_64" not in names]
