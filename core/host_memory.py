"""Freed host memory goes back to the kernel, so a rank's resident size follows what it holds.

glibc's malloc keeps freed memory for reuse. Two of its habits cost a training process on the CPU
most of the memory that sharding saves: (1) its mmap threshold is dynamic, rising after each free
of a large block up to 32 MiB, after which parameter-sized tensors come from the heap and their
freed holes stay resident; ZeRO-3 gathers and frees every parameter twice per step, and a run's
resident size grew by ~100 MiB per step (measured: +714 MiB after 3 steps of a 25M-parameter GPT
at dp=4, against +403 MiB with the threshold fixed). (2) pages freed between kept blocks stay
resident until ``malloc_trim``. Here the threshold is fixed at 128 KiB, glibc's own starting value
without its rise: blocks of 128 KiB and more (activations, gathered parameters, buckets) are
their own mappings, returned on free; smaller tensors stay on the fast heap. A 1 MiB threshold left
the activations of a small micro-batch (128 KiB-1 MiB each) on the heap, where blocks kept between
them held their freed pages: a 110M-parameter GPT under ZeRO-3 at dp=4 (micro-batch 4) kept
~300 MiB per rank resident that ``malloc_trim`` could return and grew by ~40 MiB per step; at
128 KiB its peak fell 956 -> 847 MiB above start and stayed flat. :func:`return_freed_memory`
trims on demand. On other C libraries both do nothing.
"""

from __future__ import annotations

import ctypes
import functools

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number; setting it turns the dynamic rise off
MMAP_THRESHOLD_BYTES = 128 << 10


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt, libc.malloc_trim  # noqa: B018 (glibc has both)
        return libc
    except (OSError, AttributeError):
        return None


def fix_mmap_threshold() -> None:
    """Blocks of 128 KiB and more are mmapped and go back to the kernel when freed (called once
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
