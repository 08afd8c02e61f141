"""Ring all-reduce of gradients (``comm=allreduce``, the default): each bucket is averaged over
the data-parallel group with one all-reduce, as NCCL and gloo do it. Registered as an explicit
DDP communication hook so that a different ``comm=`` plugin swaps in at the same point."""

from __future__ import annotations

from plait import hookimpl
from plait.types import PluginInfo


@hookimpl
def plait_declare() -> PluginInfo:
    return PluginInfo(name="allreduce", selected_by={"comm.name": "allreduce"},
                      description="ring all-reduce of gradient buckets over the dp group")


@hookimpl
def plait_comm_hook(topology):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    return topology.get_data_parallel_group(), allreduce_hook
