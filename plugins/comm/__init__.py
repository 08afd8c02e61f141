"""``comm=allreduce`` (the default): the strategy's own bucketed ring all-reduce of gradients
(DDP's C++ reducer averaging each bucket over the data-parallel group; DeepSpeed's ZeRO
reduce-scatter). It answers no ``plait_comm_hook``: no hook means the built-in path, which costs
no Python per bucket (measured: about 1% of a step against ``allreduce_hook`` as a comm hook,
see docs/benchmarks.md). Other ``comm=`` plugins return a DDP comm hook; plugins that cannot take
one (ZeRO, the pipeline's flat all-reduce) accept only this choice."""

from __future__ import annotations

from plait import hookimpl
from plait.types import PluginInfo


@hookimpl
def plait_declare() -> PluginInfo:
    return PluginInfo(name="allreduce", selected_by={"comm.name": "allreduce"},
                      description="the strategy's built-in ring all-reduce of gradients")
