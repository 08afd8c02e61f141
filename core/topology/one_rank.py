"""Process groups that hold one rank, made without a communicator of their own (and a group of
every rank, which is the job's own).

A mesh axis of size 1 (``pp``, ``cp`` and ``tp`` in a data-parallel run) still has a group per
rank, and torch gives each group its own backend. Over gloo that is a transport device whose
loop thread wakes every 10 ms (gloo's ``tcp::Loop`` polls ``epoll_wait`` with a 10 ms timeout)
and two worker threads: the three idle groups of a zero1 worker preempted its training threads
~80 more times a second and cost the step 2-3% on a 2-core host (docs/benchmarks.md, issue 32).

A collective over one rank moves nothing. torch's in-process ``fake`` backend
(``FakeProcessGroup``) does what it does: all-reduce, reduce, broadcast and barrier leave the
tensor as it is; gathers, scatters, reduce-scatters and all-to-alls copy the input to the
output; and it starts no thread. torchtitan gives the size-1 axes of its mesh the same backend
(``ParallelDims.build_mesh``). Only where the job runs on gloo: NCCL makes a group's
communicator on the group's first collective, so an idle size-1 group costs nothing there.
(The one collective the fake backend gets wrong over one rank, ``PREMUL_SUM``, scales; gloo has
none.)
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def one_rank_backend(device: torch.device) -> str | None:
    """The backend of a group of one rank for a job computing on ``device``: torch's ``fake``
    on the host (registered by importing the module torch keeps it in), None (the job's own)
    elsewhere."""
    if device.type != "cpu":
        return None
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  registers "fake"

    return dist.Backend.FAKE


def new_subgroup(enumeration: list[list[int]], device: torch.device) -> dist.ProcessGroup | None:
    """This rank's group of ``enumeration`` (every rank calls it, in the same order): groups of
    one rank without a communicator (:func:`one_rank_backend`), and a group of every rank the
    job's own, as ``init_device_mesh`` reuses it for an axis that spans the job (a second gloo
    group over the same ranks would be a second device and loop thread)."""
    if len(enumeration) == 1 and len(enumeration[0]) == dist.get_world_size():
        return dist.group.WORLD
    one_rank = all(len(ranks) == 1 for ranks in enumeration)
    backend = one_rank_backend(device) if one_rank else None
    return dist.new_subgroups_by_enumeration(enumeration, backend=backend)[0]
