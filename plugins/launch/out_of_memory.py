"""A worker the kernel killed for memory, told as such, with the settings that use less.

When the kernel's OOM killer ends a worker, torch elastic reports ``exitcode: -9 (SIGKILL)`` and
"Signal 9 (SIGKILL) received": nothing in the failure says memory, and the user is left to find
the kernel's log. The launcher reads the kernel's count of OOM kills (``oom_kill`` in
``/proc/vmstat``, Linux 4.13 and later; it counts a memory cgroup's kills too) before the launch.
When the job fails with a worker ended by SIGKILL and the count rose meanwhile, the failure is
raised as :class:`WorkerOutOfMemory`: torch's ``ChildFailedError`` (what callers of
:func:`plait.api.train` already catch), its message ending with the memory the job had (its
memory cgroup's cap, else the machine's) and what fits in less. The count is the machine's, so
an OOM kill elsewhere on the machine during the run with a worker SIGKILLed by someone else would
read the same: the message says how many kills the kernel counted.
"""

from __future__ import annotations

from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from plait.host_memory import memory_cap_advice, resolve

GIB = 1 << 30
VMSTAT = Path("/proc/vmstat")
MEMINFO = Path("/proc/meminfo")
CGROUPS = Path("/sys/fs/cgroup")
SIGKILL_EXIT = -9  # torch elastic's exitcode for a worker ended by SIGKILL


class WorkerOutOfMemory(ChildFailedError):
    """``ChildFailedError`` of a job whose worker the kernel killed for memory; its message ends
    with ``advice``."""

    def __init__(self, failed: ChildFailedError, advice: str):
        self.advice = advice  # before ChildFailedError formats the message
        super().__init__(failed.name, failed.failures)

    def format_msg(self, boarder_delim="=", section_delim="-"):
        return f"{super().format_msg(boarder_delim, section_delim)}\n{self.advice}"


def oom_kill_count() -> int | None:
    """The kernel's count of processes its OOM killer ended since boot, or None where the kernel
    does not tell."""
    try:
        lines = VMSTAT.read_text().splitlines()
    except OSError:
        return None
    return next((int(line.split()[1]) for line in lines if line.startswith("oom_kill ")), None)


def memory_cap() -> tuple[int, str]:
    """The memory this process and its children may use, in bytes, and where the cap comes from:
    the smallest memory cgroup limit on the way to the root (v1 or v2), else the machine's."""
    total = next(
        int(line.split()[1]) * 1024
        for line in MEMINFO.read_text().splitlines()
        if line.startswith("MemTotal:")
    )
    limits = [limit for limit in cgroup_limits() if limit < total]
    return (min(limits), "its memory cgroup") if limits else (total, "this machine")


def cgroup_limits() -> list[int]:
    """The memory limits of this process's cgroup and of each cgroup above it."""
    found = []
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):  # v1: the memory hierarchy's own mount
            root, limit_file = CGROUPS / "memory", "memory.limit_in_bytes"
        elif controllers == "":  # v2: the unified hierarchy, alone or beside v1
            unified = CGROUPS if (CGROUPS / "cgroup.controllers").exists() else CGROUPS / "unified"
            root, limit_file = unified, "memory.max"
        else:
            continue
        group = root / path.lstrip("/")
        while group != root.parent and group.is_relative_to(root):
            try:
                text = (group / limit_file).read_text().strip()
            except OSError:
                text = "max"
            if text != "max":
                found.append(int(text))
            group = group.parent
    return found


def out_of_memory(
    failed: ChildFailedError,
    kills_before: int | None,
    allocator: str | None,
    nproc: int,
    world_size: int,
) -> WorkerOutOfMemory | None:
    """``failed`` told as a kill for memory, when a worker ended by SIGKILL and the kernel's OOM
    count rose since ``kills_before``; else None. ``allocator``: the workers' allocator
    (``launcher.allocator``) on a CPU run, None on a GPU; ``nproc``: the workers on this node."""
    kills_after = oom_kill_count()
    killed = sorted(rank for rank, f in failed.failures.items() if f.exitcode == SIGKILL_EXIT)
    if kills_before is None or kills_after is None or kills_after <= kills_before or not killed:
        return None
    cap, source = memory_cap()
    share = f"{cap / nproc / GIB:.2f}"
    lines = [
        f"plait: rank{'s' * (len(killed) > 1)} {', '.join(map(str, killed))} ended by SIGKILL "
        f"while the kernel's out-of-memory killer ended {kills_after - kills_before} "
        f"process(es) on this machine: the job outgrew the {cap / GIB:.1f} GiB of {source} "
        f"({share} GiB for each of the {nproc} workers on this node).",
        "Less memory: a sharding strategy (strategy=zero3 or fsdp), "
        "train.activation_checkpointing=full, a smaller train.batch_size or model; "
        f"`plait plan --search world_size={world_size} --memory-gb {share} <this run's "
        "overrides>` ranks the layouts estimated to fit (model states and activations, not what "
        "each process starts with).",
    ]
    hint = memory_cap_advice(resolve(allocator)) if allocator is not None else None
    return WorkerOutOfMemory(failed, "\n".join(lines + [hint] * (hint is not None)))
