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
largest GPT a 4 GiB job held had 2-23% fewer layers than under ``glibc_mmap``. Its aggressive
decommit gives ``glibc_mmap``'s memory back at 1.2-1.6x the step (``glibc_mmap``'s own: 1.5-1.7x),
so a worker on tcmalloc turns it on only while the job is near its memory cap
(``launcher.decommit_above``, :mod:`plait.memory_cap`): the 4 GiB job then holds as many layers
as under ``glibc_mmap`` or more, and a job far from its cap keeps tcmalloc's step.

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

from plait.memory_cap import decommit_near_cap

ALLOCATORS = ("auto", "tcmalloc", "jemalloc", "glibc", "glibc_mmap")
# the shared library each preloaded allocator is, by the name ldconfig knows (Debian's packages)
# in the order ``auto`` tries them
LIBRARIES = {"tcmalloc": "tcmalloc_minimal", "jemalloc": "jemalloc"}
PACKAGES = {"tcmalloc": "libtcmalloc-minimal4", "jemalloc": "libjemalloc2"}
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number; setting it turns the dynamic rise off
MMAP_THRESHOLD_BYTES = 128 << 10
JEMALLOC_ALL_ARENAS = 4096  # MALLCTL_ARENAS_ALL: "arena.4096.purge" purges every arena
DECOMMIT_ABOVE = 0.8  # launcher.decommit_above's default


@functools.cache
def library_of(allocator: str) -> str | None:
    """The installed shared library of ``tcmalloc`` or ``jemalloc`` (its soname), or None."""
    return ctypes.util.find_library(LIBRARIES[allocator])


def resolve(choice: str) -> str:
    """``auto`` made concrete on this machine: tcmalloc, else jemalloc, else glibc."""
    if choice != "auto":
        return choice
    return next((name for name in LIBRARIES if library_of(name)), "glibc")


def allocator_problems(choice: str, decommit_above: float = DECOMMIT_ABOVE) -> list[str]:
    """Refusals of ``launcher.allocator`` and ``launcher.decommit_above`` before launch."""
    problems = []
    if not 0 < decommit_above <= 1:
        problems.append(
            f"launcher.decommit_above={decommit_above}: give the share of the job's memory cap "
            "above which tcmalloc hands freed memory back, in (0, 1] (1: never; default "
            f"{DECOMMIT_ABOVE})"
        )
    if choice not in ALLOCATORS:
        problems.append(f"launcher.allocator={choice}: choose one of {', '.join(ALLOCATORS)}")
    elif choice in LIBRARIES and library_of(choice) is None:
        problems.append(
            f"launcher.allocator={choice}: lib{LIBRARIES[choice]} is not installed on this "
            f"machine: install it (Debian: apt-get install {PACKAGES[choice]}), or set "
            "launcher.allocator=auto (the best one found) or glibc"
        )
    return problems


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


def memory_cap_advice(allocator: str, decommit_above: float) -> str | None:
    """What a CPU run on ``allocator`` (resolved) that outgrew its memory cap may change, or None
    where the allocator already hands every freed block back."""
    if allocator == "glibc_mmap":
        return None
    if allocator == "tcmalloc" and decommit_above < 1:
        return (
            "The workers ran on tcmalloc, which hands freed memory back from "
            f"launcher.decommit_above={decommit_above} of the cap: a lower share "
            "(launcher.decommit_above=0.5) does so sooner, at a slower step."
        )
    if allocator == "tcmalloc":
        return (
            "The workers ran on tcmalloc with launcher.decommit_above=1, which keeps freed memory "
            f"for reuse: launcher.decommit_above={DECOMMIT_ABOVE} (the default) hands it back "
            "near the cap (a 4 GiB job held 7-29% more layers)."
        )
    return (
        f"The workers ran on {allocator}, which keeps freed memory for reuse: "
        "launcher.allocator=tcmalloc hands it back near the cap (launcher.decommit_above), "
        "launcher.allocator=glibc_mmap at every free, at a slower step."
    )


def configure_worker(choice: str, decommit_above: float = DECOMMIT_ABOVE) -> None:
    """In a CPU worker: ``glibc_mmap`` fixes glibc's mmap threshold at 128 KiB (unless
    ``MALLOC_MMAP_THRESHOLD_`` in the environment says otherwise); the other choices were made
    when the worker started. On tcmalloc, freed memory goes back near the job's memory cap
    (``launcher.decommit_above``, :mod:`plait.memory_cap`)."""
    libc = _glibc()
    if choice == "glibc_mmap" and libc is not None and "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
    decommit_near_cap(decommit_above)


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
