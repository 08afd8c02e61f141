"""Freed host memory goes back to the kernel, so a rank's resident size follows what it holds.

glibc's malloc keeps freed memory for reuse. Two of its habits cost a training process on the CPU
most of the memory that sharding saves: (1) its mmap threshold is dynamic, rising after each free
of a large block up to 32 MiB, after which parameter-sized tensors come from the heap and their
freed holes stay resident; ZeRO-3 gathers and frees every parameter twice per step, and a run's
resident size grew by ~100 MiB per step (measured: +714 MiB after 3 steps of a 25M-parameter GPT
at dp=4, against +403 MiB with the threshold fixed). (2) pages freed between kept blocks stay
resident until ``malloc_trim``. Here the threshold is fixed at 1 MiB (blocks of 1 MiB and more are
their own mappings, returned on free; small tensors stay on the fast heap), and
:func:`return_freed_memory` trims on demand. On other C libraries both do nothing.
"""

from __future__ import annotations

import ctypes
import functools

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number; setting it turns the dynamic rise off
MMAP_THRESHOLD_BYTES = 1 << 20


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt, libc.malloc_trim  # noqa: B018 (glibc has both)
        return libc
    except (OSError, AttributeError):
        return None


def fix_mmap_threshold() -> None:
    """Blocks of 1 MiB and more are mmapped and go back to the kernel when freed (called once
    per CPU worker; ``MALLOC_MMAP_THRESHOLD_`` in the environment takes precedence)."""
    import os

    libc = _glibc()
    if libc is not None and "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)


def return_freed_memory() -> None:
    """Hand freed heap pages back to the kernel (glibc's ``malloc_trim``)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
