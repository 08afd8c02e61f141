"""A worker the kernel killed for memory, told as such, with the settings that use less.

When the kernel's OOM killer ends a worker, torch elastic reports ``exitcode: -9 (SIGKILL)``, or
often only the lost connection of another rank that noticed first: nothing in the failure says
memory, and the user is left to find the kernel's log. The launcher reads the kernel's count of
OOM kills (``oom_kill`` in ``/proc/vmstat``, Linux 4.13 and later; it counts a memory cgroup's
kills too) before the launch. When the job fails and the count rose meanwhile, the failure is
raised as :class:`WorkerOutOfMemory`: torch's ``ChildFailedError`` (what callers of
:func:`plait.api.train` already catch), its message ending with the memory the job had (its
memory cgroup's cap, else the machine's) and what fits in less. The count is the machine's, so an
OOM kill elsewhere on the machine during a run that failed for another reason would read the
same: the message says how many kills the kernel counted, and which ranks torch saw end by
SIGKILL.
"""

from __future__ import annotations

from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from plait.host_memory import memory_cap_advice, resolve
from plait.memory_cap import GIB, memory_cap

VMSTAT = Path("/proc/vmstat")
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


def out_of_memory(
    failed: ChildFailedError,
    kills_before: int | None,
    allocator: str | None,
    decommit_above: float,
    nproc: int,
    world_size: int,
) -> WorkerOutOfMemory | None:
    """``failed`` told as a kill for memory, when the kernel's OOM count rose since
    ``kills_before``; else None. ``allocator``: the workers' allocator (``launcher.allocator``) on
    a CPU run, None on a GPU, with ``launcher.decommit_above``; ``nproc``: the workers on this
    node. The rank killed is named when torch recorded it; often the first failure torch sees is
    another rank's lost connection."""
    kills_after = oom_kill_count()
    if kills_before is None or kills_after is None or kills_after <= kills_before:
        return None
    killed = sorted(rank for rank, f in failed.failures.items() if f.exitcode == SIGKILL_EXIT)
    who = (
        f"rank{'s' * (len(killed) > 1)} {', '.join(map(str, killed))}, ended by SIGKILL"
        if killed
        else "one of the workers, most likely (the failure above can be another rank losing it)"
    )
    cap = memory_cap()
    share = f"{cap.limit / nproc / GIB:.2f}"
    lines = [
        f"plait: the kernel's out-of-memory killer ended {kills_after - kills_before} "
        f"process(es) on this machine while the job ran: {who}. The job outgrew the "
        f"{cap.limit / GIB:.1f} GiB of {cap.source} ({share} GiB for each of the {nproc} "
        "workers on this node).",
        "Less memory: a sharding strategy (strategy=zero3 or fsdp), "
        "train.activation_checkpointing=full, a smaller train.batch_size or model; "
        f"`plait plan --search world_size={world_size} --memory-gb {share} <this run's "
        "overrides>` ranks the layouts estimated to fit (model states and activations, not what "
        "each process starts with).",
    ]
    hint = memory_cap_advice(resolve(allocator), decommit_above) if allocator else None
    return WorkerOutOfMemory(failed, "\n".join(lines + [hint] * (hint is not None)))
