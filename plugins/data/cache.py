"""The node-local shard cache: shards of a remote dataset (any fsspec URL) are copied on demand
into ``data.cache_dir`` and evicted least-recently-used beyond ``data.cache_limit_gb``.

One copy per node without a collective: every process of the node (ranks, their loader
threads, DataLoader workers) shares the directory, and a shard is fetched under an exclusive
``flock`` of its lock file, so whoever asks first downloads it while the others wait and then
read the local copy. A download goes to a temp file created at the shard's full size, so the
size of the directory (complete shards + downloads in flight) is what the limit bounds; room is
made under a lock of the whole cache before each download. A read opens the shard file; an
eviction only unlinks it, so a read in progress keeps its data, and a read that finds its shard
gone fetches it again. "Recently used" is the file's mtime, touched on every use.

A shard enters the cache only whole and intact: it is hashed (xxh3_64) as it is copied and
compared with the checksum its index records (and its byte count with the size), before it is
renamed into place; a mismatch deletes the download and raises
:class:`~plait.plugins.data.index.ShardChecksumError` naming the shard and both checksums.

This is MosaicML Streaming's design (one download per node, LRU eviction by ``cache_limit``)
with file locks instead of Streaming's shared-memory registry.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import threading
import time
from collections import deque
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Hashable, Iterable, Iterator, Optional

import xxhash

from plait.plugins.data.index import ShardChecksumError, verify

GIB = 2**30
FETCH_SUFFIX = ".fetch"  # a download in flight
COPY_CHUNK = 1 << 20


def cache_key(url: str) -> str:
    return hashlib.sha256(url.encode()).hexdigest()[:16]


@contextmanager
def locked(path: Path):
    with open(path, "a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class NodeCache:
    """Shards ``remote/<name>`` cached as ``<cache_dir>/shards/<hash of remote>/<name>``.

    :param limit_bytes: the most the whole ``<cache_dir>/shards`` tree may hold (all datasets
        cached there); None: no limit.
    """

    def __init__(self, remote: str, cache_dir: str | Path, limit_bytes: Optional[int]):
        self.remote = remote.rstrip("/")
        self.root = Path(cache_dir).expanduser() / "shards"
        self.dir = self.root / cache_key(self.remote)
        self.limit_bytes = limit_bytes
        self._fs = None  # opened lazily in each process (fsspec objects are not fork-safe)
        self._touched: dict[str, float] = {}  # shard name -> when this process last touched it

    @property
    def fs(self):
        if self._fs is None:
            from fsspec.core import url_to_fs

            self._fs, self._remote_path = url_to_fs(self.remote)
        return self._fs

    def __getstate__(self):
        return {**self.__dict__, "_fs": None}

    def ensure(self, name: str, size: int, checksum: Optional[str] = None) -> Path:
        """The local copy of shard ``name`` (``size`` bytes), fetched if it is not cached and
        checked against ``checksum`` (its xxh3_64; None: an index without checksums)."""
        path = self.dir / name
        if self._touch(path):
            return path
        self.dir.mkdir(parents=True, exist_ok=True)
        with locked(self.dir / f".{name}.lock"):
            if self._touch(path):  # another process fetched it while we waited
                return path
            tmp = self.dir / f".{name}{FETCH_SUFFIX}"
            self._make_room(tmp, size)
            fs = self.fs
            try:
                digest, copied = xxhash.xxh3_64(), 0
                with fs.open(f"{self._remote_path}/{name}", "rb") as src, open(tmp, "r+b") as dst:
                    while chunk := src.read(COPY_CHUNK):
                        dst.write(chunk)
                        digest.update(chunk)
                        copied += len(chunk)
                url = f"{self.remote}/{name}"
                if copied != size:
                    raise ShardChecksumError(
                        f"shard {url} is truncated or grown: {copied} bytes, but index.json "
                        f"records {size}; it is not read: restore the file, or run plait "
                        "prepare again"
                    )
                verify(url, digest.hexdigest(), checksum)
                with locked(self.root / ".lock"):  # an eviction counting now sees tmp or path
                    os.replace(tmp, path)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
        return path

    def read(
        self, name: str, size: int, offset: int, nbytes: int, checksum: Optional[str] = None
    ) -> bytes:
        """``nbytes`` bytes of shard ``name`` at ``offset``, from the local copy."""
        path = os.path.join(self.dir, name)
        while True:
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:  # not cached, or evicted since: fetch it
                self.ensure(name, size, checksum)
                continue
            try:
                data = os.pread(fd, nbytes, offset)
            finally:
                os.close(fd)
            now = time.monotonic()  # "recently used" to the second: one utime per shard and second
            if now - self._touched.get(name, 0.0) > 1.0 and self._touch(Path(path)):
                self._touched[name] = now
            return data

    @staticmethod
    def _touch(path: Path) -> bool:
        try:
            os.utime(path)
            return True
        except FileNotFoundError:
            return False

    def usage(self) -> int:
        """Bytes held under the cache root: complete shards and downloads in flight."""
        total = 0
        for entry in self.root.glob("*/*"):
            try:
                total += entry.stat().st_size
            except FileNotFoundError:
                pass
        return total

    def _make_room(self, tmp: Path, size: int) -> None:
        """Evict least-recently-used shards until ``size`` more bytes fit, then create ``tmp``
        at that size (so other processes count it), all under the cache-wide lock."""
        if self.limit_bytes is not None and size > self.limit_bytes:
            raise ValueError(
                f"a shard of {size} bytes does not fit data.cache_limit_gb="
                f"{self.limit_bytes / GIB:g}: raise the limit"
            )
        while True:
            with locked(self.root / ".lock"):
                if self.limit_bytes is None or self._evict(self.limit_bytes - size):
                    with open(tmp, "wb") as f:
                        f.truncate(size)
                    return
            time.sleep(0.05)  # the rest is downloads in flight: wait for them to finish

    def _evict(self, keep_at_most: int) -> bool:
        """Delete the least recently used complete shards until the cache holds at most
        ``keep_at_most`` bytes; False when downloads in flight alone exceed it."""
        shards, total = [], 0
        for entry in self.root.glob("*/*"):
            try:
                st = entry.stat()
            except FileNotFoundError:
                continue
            total += st.st_size
            if not entry.name.startswith("."):
                shards.append((st.st_mtime_ns, st.st_size, entry))
        for _, size, entry in sorted(shards, key=lambda s: s[0]):
            if total <= keep_at_most:
                break
            entry.unlink(missing_ok=True)
            total -= size
        return total <= keep_at_most


class ShardPrefetcher:
    """A background thread that fetches the shards of the coming steps, at most ``depth``
    shards ahead of the step being loaded, so a step never waits on storage once warm.

    :param steps: the sample ids of each coming step (this rank's), from the current position.
    :param shard_keys: the shards a step's samples need, in order.
    :param fetch: fetches one shard into the cache (blocking).
    """

    def __init__(
        self,
        steps: Iterator[list[int]],
        shard_keys: Callable[[list[int]], list],
        fetch: Callable[[Hashable], None],
        depth: int,
    ):
        self.steps, self.shard_keys, self.fetch, self.depth = steps, shard_keys, fetch, depth
        self.loading = 0  # the step the loader is on, counted from this prefetcher's start
        self.ahead: deque[tuple[Hashable, int]] = deque()  # shards fetched, and their step
        self.cond = threading.Condition()
        self.stopped = False
        self.error: Optional[BaseException] = None
        self.thread = threading.Thread(target=self._run, daemon=True, name="plait-prefetch")
        self.thread.start()

    def advance(self, step: int) -> None:
        with self.cond:
            self.loading = step
            self.cond.notify_all()

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()

    def _waiting_room(self, key: Hashable) -> bool:
        while self.ahead and self.ahead[0][1] < self.loading:
            self.ahead.popleft()
        pending = {k for k, _ in self.ahead}
        return key in pending or len(pending) < self.depth

    def _run(self) -> None:
        try:
            for step, ids in enumerate(self.steps):
                for key in self.shard_keys(ids):
                    with self.cond:
                        while not self.stopped and not self._waiting_room(key):
                            self.cond.wait()
                        if self.stopped:
                            return
                        self.ahead.append((key, step))
                    self.fetch(key)
        except BaseException as e:  # a loader read of the same shard raises it where it counts
            self.error = e


def shard_keys_in_order(keys: Iterable[Hashable]) -> list:
    """Keys without repeats, in the order first needed."""
    return list(dict.fromkeys(keys))
