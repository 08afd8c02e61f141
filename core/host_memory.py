"""The workers' host memory allocator (``launcher.allocator``), and freed memory handed back.

A training process on the CPU allocates and frees every activation of every step, and under ZeRO-3
or FSDP every gathered parameter too. glibc's malloc, the default, serves that fast from its heap
but keeps what was freed: its mmap threshold rises after each free of a large block (up to 32 MiB),
after which parameter-sized blocks come from the heap and the holes between kept blocks stay
resident (issue 20: a ZeRO-3 rank grew ~100 MiB per step). Issue 20 fixed the threshold at 128 KiB,
which returned every block of 128 KiB and more to the kernel on free; but then every activation is
a mapping of its own, faulted in and zeroed on every step, and a DDP step on two CPU ranks took
~30% longer than a plain torch loop's (issue 32). Measured side by side (docs/benchmarks.md, "Host
memory allocator"), jemalloc and tcmalloc (torch's CPU performance guide recommends either) came
within 3-7% of the threshold's resident memory per rank on a GPT 4 x 256, at about glibc's speed;
on a GPT 8 x 768 jemalloc's steps took 1.11x (ddp) to 1.46x (zero3) glibc's (its default decay
hands freed pages back and faults them in again) where tcmalloc's took 0.90-0.99x, with each rank's
peak within 5% of jemalloc's (a 4-process job's within 3%, but zero1 and zero2 +8%, pp2 +16%). So
``auto`` takes tcmalloc first. What tcmalloc gives up: it keeps freed spans for reuse, so the
largest GPT a 4 GiB job holds has 2-23% fewer layers than under ``glibc_mmap`` (issue 20's ratios
between layouts still met). Its aggressive decommit (``TCMALLOC_AGGRESSIVE_DECOMMIT=true`` in the
environment, read when tcmalloc loads) gives ``glibc_mmap``'s memory back at 1.2-1.6x the step
(``glibc_mmap``'s own: 1.5-1.7x). No choice here has both; a run that must fit a memory cap takes
one of those two:

==============  ====================================================================
``auto``        tcmalloc where it is installed, else jemalloc, else glibc (the default)
``tcmalloc``    ``libtcmalloc_minimal.so.4`` preloaded into the workers (Debian:
                libtcmalloc-minimal4)
``jemalloc``    ``libjemalloc.so.2`` preloaded (Debian: libjemalloc2)
``glibc``       glibc's malloc as it is: what a plain torch loop gets
``glibc_mmap``  glibc with issue 20's fixed 128 KiB mmap threshold: the least resident memory
                glibc gives, the slowest steps
==============  ====================================================================

A library is preloaded (``LD_PRELOAD``) into the workers that ``launcher=local`` starts on a
CPU run (the forkserver and spawned workers alike); under ``torchrun`` or ``srun`` the process
is already running, and its launcher's environment decides. ``glibc_mmap`` is set in the worker
itself (``mallopt``). GPU runs keep their process's allocator. :func:`return_freed_memory`
hands freed pages back on demand, whichever of the three allocators the process runs on (the
meta-device build calls it after each module it cuts).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

ALLOCATORS = ("auto", "tcmalloc", "jemalloc", "glibc", "glibc_mmap")
# the shared library each preloaded allocator is, by the name ldconfig knows (Debian's packages)
# in the order ``auto`` tries them
LIBRARIES = {"tcmalloc": "tcmalloc_minimal", "jemalloc": "jemalloc"}
PACKAGES = {"tcmalloc": "libtcmalloc-minimal4", "jemalloc": "libjemalloc2"}
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number; setting it turns the dynamic rise off
MMAP_THRESHOLD_BYTES = 128 << 10
JEMALLOC_ALL_ARENAS = 4096  # MALLCTL_ARENAS_ALL: "arena.4096.purge" purges every arena


@functools.cache
def library_of(allocator: str) -> str | None:
    """The installed shared library of ``tcmalloc`` or ``jemalloc`` (its soname), or None."""
    return ctypes.util.find_library(LIBRARIES[allocator])


def resolve(choice: str) -> str:
    """``auto`` made concrete on this machine: tcmalloc, else jemalloc, else glibc."""
    if choice != "auto":
        return choice
    return next((name for name in LIBRARIES if library_of(name)), "glibc")


def allocator_problems(choice: str) -> list[str]:
    """Refusals of ``launcher.allocator`` before launch."""
    if choice not in ALLOCATORS:
        return [f"launcher.allocator={choice}: choose one of {', '.join(ALLOCATORS)}"]
    if choice in LIBRARIES and library_of(choice) is None:
        return [
            f"launcher.allocator={choice}: lib{LIBRARIES[choice]} is not installed on this "
            f"machine: install it (Debian: apt-get install {PACKAGES[choice]}), or set "
            "launcher.allocator=auto (the best one found) or glibc"
        ]
    return []


def preload(choice: str) -> str | None:
    """The library to put in the workers' ``LD_PRELOAD`` for ``launcher.allocator=choice``."""
    name = resolve(choice)
    return library_of(name) if name in LIBRARIES else None


def with_preload(environ: dict[str, str], library: str | None) -> dict[str, str]:
    """``environ`` with ``library`` first in ``LD_PRELOAD`` (and nothing else changed)."""
    if library is None:
        return environ
    kept = [p for p in environ.get("LD_PRELOAD", "").split() if p != library]
    return {**environ, "LD_PRELOAD": " ".join([library, *kept])}


def memory_cap_advice(allocator: str) -> str | None:
    """What a CPU run on ``allocator`` (resolved) that outgrew its memory cap may change, or None
    where the allocator already hands freed memory back."""
    if allocator == "glibc_mmap":
        return None
    decommit = " (or TCMALLOC_AGGRESSIVE_DECOMMIT=true in the environment)" * (
        allocator == "tcmalloc"
    )
    return (
        f"The workers ran on {allocator}, which keeps freed memory for reuse: "
        f"launcher.allocator=glibc_mmap{decommit} hands it back to the kernel, at a slower step "
        "(a 4 GiB job held 2-23% more layers than on tcmalloc, at 1.2-1.7x its step; "
        "docs/benchmarks.md)."
    )


def configure_worker(choice: str) -> None:
    """In a CPU worker: ``glibc_mmap`` fixes glibc's mmap threshold at 128 KiB (unless
    ``MALLOC_MMAP_THRESHOLD_`` in the environment says otherwise); the other choices were made
    when the worker started."""
    libc = _glibc()
    if choice == "glibc_mmap" and libc is not None and "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)


def running_allocator() -> str:
    """Which allocator serves this process's ``malloc``: jemalloc, tcmalloc or glibc."""
    process = ctypes.CDLL(None)
    if hasattr(process, "mallctl"):
        return "jemalloc"
    if hasattr(process, "MallocExtension_ReleaseFreeMemory"):
        return "tcmalloc"
    return "glibc"


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt, libc.malloc_trim  # noqa: B018 (glibc has both)
        return libc
    except (OSError, AttributeError):
        return None


@functools.cache
def _release():
    """The call that hands freed pages back to the kernel in the running allocator."""
    allocator = running_allocator()
    process = ctypes.CDLL(None)
    if allocator == "jemalloc":
        purge = f"arena.{JEMALLOC_ALL_ARENAS}.purge".encode()
        return lambda: process.mallctl(purge, None, None, None, ctypes.c_size_t(0))
    if allocator == "tcmalloc":
        return process.MallocExtension_ReleaseFreeMemory
    libc = _glibc()
    return (lambda: libc.malloc_trim(0)) if libc is not None else (lambda: None)


def return_freed_memory() -> None:
    """Hand freed heap pages back to the kernel (glibc's ``malloc_trim``, jemalloc's arena
    purge, tcmalloc's ``ReleaseFreeMemory``)."""
    _release()()
