"""The memory a job may use (its memory cgroup's cap, else the machine's), and tcmalloc made to
hand freed memory back while the job is near that cap (``launcher.decommit_above``).

tcmalloc, ``launcher.allocator=auto``'s choice, keeps freed spans for reuse: steps as fast as
glibc's, but the largest GPT a 4 GiB job held had 2-23% fewer layers than under ``glibc_mmap``
(issue 32). Its aggressive decommit hands every freed span back at once and gives
``glibc_mmap``'s memory, at 1.2-1.6x the step. The step is worth more while memory is plentiful,
the decommit only near the cap, so each CPU worker on tcmalloc runs a thread that reads the
job's anonymous memory (the cgroup's ``memory.stat``: ``total_rss`` on cgroup v1, ``anon`` on v2;
without a cgroup cap below the machine's memory, MemTotal - MemAvailable) and turns tcmalloc's
``tcmalloc.aggressive_memory_decommit`` on above ``decommit_above`` of the cap (handing back what
is free at that moment too), and off again below ``decommit_above - 0.1``. It reads every
``FAR_INTERVAL_S`` while the job holds less than half of that line and every ``NEAR_INTERVAL_S``
above it: a file read of ~27 us, off the step's critical path. Half a second far from the line:
a job here grew by at most 219 MiB in 0.1 s, 361 MiB in 0.5 s and 552 MiB in 1 s (an 8 x 1024
GPT under fsdp: its build, steps and save; docs/benchmarks.md), where half the default line is
0.4 of the cap, 1.6 GiB of a 4 GiB one; each wake cost a worker ~0.3 ms of CPU on a busy host
(``bench_parity.py --threads``), ten a second at 0.1 s. The cap is the tightest
``memory.limit_in_bytes`` (v1) or ``memory.max`` (v2) on the way from this process's cgroup to
the root: the one whose kill would end the job.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

GIB = 1 << 30
CGROUPS = Path("/sys/fs/cgroup")
MEMINFO = Path("/proc/meminfo")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")  # this process's cgroup in each hierarchy
DECOMMIT_PROPERTY = b"tcmalloc.aggressive_memory_decommit"
HYSTERESIS = 0.1  # decommit goes off this share of the cap below the line it came on at
FAR_INTERVAL_S, NEAR_INTERVAL_S = 0.5, 0.01


@dataclass(frozen=True)
class MemoryCap:
    """``limit`` bytes, from ``source`` ("its memory cgroup" or "this machine"); ``stat``: the
    cgroup's ``memory.stat`` and the line of its anonymous bytes, None for the machine."""

    limit: int
    source: str
    stat: Path | None = None
    anon_key: str = ""

    def used(self) -> int:
        """The anonymous memory the cap counts now (what a kill for memory is decided on); for
        the machine, ``limit`` is its MemTotal."""
        if self.stat is None:
            return self.limit - figure(MEMINFO, "MemAvailable:") * 1024
        return figure(self.stat, self.anon_key)


def figure(path: Path, name: str) -> int:
    """The number on the line of ``path`` that starts with ``name`` (``memory.stat``'s
    ``anon``; ``/proc/meminfo``'s ``MemAvailable:``, in kB), for the watcher below: one line
    found is ~27 us here, the whole file parsed ~135 us (at which, ten reads a second,
    ``bench_parity.py --threads`` read the watcher at 0.4-0.5% of a core)."""
    prefix = (name if name.endswith(":") else f"{name} ").encode()
    for line in path.read_bytes().splitlines():
        if line.startswith(prefix):
            return int(line.split()[1])
    raise ValueError(f"{path} has no {name} line")


def memory_cap() -> MemoryCap:
    """The tightest memory cgroup cap on the way from this process's cgroup to the root (v1 or
    v2), or the machine's memory where none is tighter."""
    total = figure(MEMINFO, "MemTotal:") * 1024
    caps = [cap for cap in cgroup_caps() if cap.limit < total]
    return min(caps, key=lambda cap: cap.limit) if caps else MemoryCap(total, "this machine")


def cgroup_caps() -> list[MemoryCap]:
    """The memory limit of this process's cgroup and of each cgroup above it."""
    found = []
    for line in PROC_SELF_CGROUP.read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):  # v1: the memory hierarchy's own mount
            root, limit_file, anon_key = CGROUPS / "memory", "memory.limit_in_bytes", "total_rss"
        elif controllers == "":  # v2: the unified hierarchy, alone or beside v1
            unified = CGROUPS if (CGROUPS / "cgroup.controllers").exists() else CGROUPS / "unified"
            root, limit_file, anon_key = unified, "memory.max", "anon"
        else:
            continue
        group = root / path.lstrip("/")
        while group.is_relative_to(root):
            try:
                text = (group / limit_file).read_text().strip()
            except OSError:  # no memory controller here (v2), or not visible
                text = "max"
            if text != "max":
                found.append(
                    MemoryCap(int(text), "its memory cgroup", group / "memory.stat", anon_key)
                )
            group = group.parent
    return found


class DecommitNearCap:
    """The thread that turns tcmalloc's aggressive decommit on above ``line`` of the job's memory
    cap (see the module's docstring); one per process, its line the latest run's."""

    def __init__(self, line: float, process: ctypes.CDLL):
        self.line, self.process = line, process
        self.cap = memory_cap()
        self.decommitting = self.announced = False
        threading.Thread(target=self.watch, name="plait-decommit", daemon=True).start()

    def watch(self) -> None:
        while True:
            try:
                used = self.cap.used()
            except (OSError, ValueError) as error:  # the cgroup went away, or its stat changed
                print(f"plait: the memory cap's watcher stopped: {error}", file=sys.stderr)
                return
            on_at = self.line * self.cap.limit
            if used > on_at and not self.decommitting:
                self.decommit(True)
                self.process.MallocExtension_ReleaseFreeMemory()
                if not self.announced:
                    self.announce(used)
            elif self.decommitting and (
                used < on_at - HYSTERESIS * self.cap.limit or self.line >= 1
            ):
                self.decommit(False)
            time.sleep(NEAR_INTERVAL_S if used > on_at / 2 else FAR_INTERVAL_S)

    def decommit(self, on: bool) -> None:
        self.process.MallocExtension_SetNumericProperty(DECOMMIT_PROPERTY, ctypes.c_size_t(on))
        self.decommitting = on

    def announce(self, used: int) -> None:
        print(
            f"plait: rank {os.environ.get('RANK', 0)}: the job holds {used / self.cap.limit:.0%} "
            f"of the {self.cap.limit / GIB:.1f} GiB of {self.cap.source}: tcmalloc hands freed "
            f"memory back while it stays near (launcher.decommit_above={self.line}; slower "
            "steps)",
            file=sys.stderr,
            flush=True,
        )
        self.announced = True


_watcher: DecommitNearCap | None = None


def _forget_watcher() -> None:
    global _watcher
    _watcher = None


os.register_at_fork(after_in_child=_forget_watcher)  # a fork has no thread: it starts its own


def decommit_near_cap(decommit_above: float) -> None:
    """Turn tcmalloc's aggressive decommit on above ``decommit_above`` of the job's memory cap
    (1: never), by this process's one :class:`DecommitNearCap`; nothing where the process does
    not run on tcmalloc."""
    global _watcher
    if _watcher is not None:
        _watcher.line = decommit_above
        return
    process = ctypes.CDLL(None)
    if decommit_above < 1 and hasattr(process, "MallocExtension_SetNumericProperty"):
        _watcher = DecommitNearCap(decommit_above, process)
