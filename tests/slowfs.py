"""A deliberately slow "remote" for the node-local cache: fsspec's local file system behind a
throttle, as the protocol ``slow://``. Importing this module registers it, so the tests load it
as an in-house plugin module (``+plugins=[slowfs]``) and it is known in every process: the CLI
that validates the plan, the workers, their DataLoader workers.

Reads run at ``PLAIT_SLOWFS_BYTES_PER_S`` (default 100 kB/s); every shard opened for reading is
logged to ``PLAIT_SLOWFS_LOG`` as ``<time> <pid> <file name>``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from fsspec import register_implementation
from fsspec.implementations.local import LocalFileSystem


class ThrottledFile:
    def __init__(self, f, bytes_per_s: float):
        self.f, self.bytes_per_s = f, bytes_per_s

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(n)
        time.sleep(len(data) / self.bytes_per_s)
        return data

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()

    def __getattr__(self, name):
        return getattr(self.f, name)


class SlowFileSystem(LocalFileSystem):
    protocol = ("slow",)

    def _open(self, path, mode="rb", **kwargs):
        f = super()._open(path, mode, **kwargs)
        if "r" in mode and path.endswith(".bin") and os.environ.get("PLAIT_SLOWFS_LOG"):
            with open(os.environ["PLAIT_SLOWFS_LOG"], "a") as log:
                # perf_counter: the system-wide monotonic clock on Linux, as StepClock's
                log.write(f"{time.perf_counter()} {os.getpid()} {Path(path).name}\n")
        return ThrottledFile(f, float(os.environ.get("PLAIT_SLOWFS_BYTES_PER_S", 100_000)))


def fetches(log: str | Path) -> list[tuple[float, int, str]]:
    """The shard fetches logged: (time, pid, file name)."""
    if not Path(log).exists():
        return []
    return [
        (float(t), int(pid), name)
        for t, pid, name in (line.split() for line in Path(log).read_text().splitlines())
    ]


register_implementation("slow", SlowFileSystem, clobber=True)
