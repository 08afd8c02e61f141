"""``comm=allreduce|flat|ring|hierarchical`` and ``comm.compression=none|fp16|bf16|powersgd``:
how gradients are averaged over data-parallel ranks.

    plait train comm=hierarchical comm.compression=fp16 comm.bucket_mb=4

Two plugins, one contract. Each returns a :class:`~plait.plugins.comm.reducer.Reducer`
(``plait_grad_reducer``: average a flat gradient buffer over a group, return a future) and
describes itself with a :class:`~plait.types.CommSpec` (``plait_comm_spec``):

- ``allreduce`` (the default) is the strategy's own all-reduce. DDP keeps its C++ reducer (no
  Python per bucket) and, for ``comm.compression=fp16``, torch's built-in C++ fp16 hook; engines
  without an all-reduce of their own (the pipeline's data-parallel step) get the backend's
  all-reduce through the reducer; DeepSpeed ZeRO maps the compression and bucket size onto its
  own settings.
- ``comm`` brings its own algorithm: ``flat`` (the backend's all-reduce through the reducer, the
  reference for the others), ``ring`` (``ring.py``) or ``hierarchical`` (``hierarchical.py``).
  It needs an engine that carries the choice out (``engine:grad_comm``): one that calls the
  reducer on its buckets (DDP, and the pipeline engine around it) or maps the spec onto its
  backend and refuses what it cannot map (ZeRO).

Compression composes with every algorithm: the compression is a torch comm hook and the
algorithm the process group it all-reduces over (``algorithm.py``). ``comm.bucket_mb`` is the
fusion size: DDP's ``bucket_cap_mb``, the pipeline's buckets, DeepSpeed's ``reduce_bucket_size``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch.distributed as dist

from plait import hookimpl
from plait.config import CommConfig
from plait.types import CommSpec, PluginInfo

ALGORITHMS = ("flat", "ring", "hierarchical")
COMPRESSIONS = ("none", "fp16", "bf16", "powersgd")


@dataclass
class CommSettings(CommConfig):
    name: str = "allreduce"  # allreduce | flat | ring | hierarchical
    compression: str = "none"  # none | fp16 | bf16 | powersgd
    # Gradient fusion bucket in MiB: DDP's bucket_cap_mb, the pipeline's buckets, DeepSpeed's
    # reduce_bucket_size. None: each strategy's default (DDP and the pipeline 25 MiB).
    bucket_mb: Optional[float] = None
    powersgd_rank: int = 1  # PowerSGD's matrix_approximation_rank
    powersgd_start_iter: int = 10  # steps all-reduced uncompressed first (torch needs >= 2)


def comm_spec(cfg) -> CommSpec:
    settings = cfg.comm
    bucket = None if settings.bucket_mb is None else int(settings.bucket_mb * 2**20)
    return CommSpec(algorithm=settings.name, compression=settings.compression, bucket_bytes=bucket)


def problems(cfg) -> list[str]:
    settings, found = cfg.comm, []
    if settings.compression not in COMPRESSIONS:
        found.append(
            f"comm.compression={settings.compression}: choose one of {', '.join(COMPRESSIONS)}"
        )
    if settings.bucket_mb is not None and not settings.bucket_mb > 0:
        found.append(
            f"comm.bucket_mb={settings.bucket_mb} must be positive (MiB), or null for "
            "the strategy's default"
        )
    if settings.compression == "powersgd":
        if settings.powersgd_rank < 1:
            found.append(f"comm.powersgd_rank={settings.powersgd_rank} must be at least 1")
        if settings.powersgd_start_iter < 2:
            found.append(
                f"comm.powersgd_start_iter={settings.powersgd_start_iter} must be at "
                "least 2: torch's PowerSGD keeps per-bucket error feedback, and DDP "
                "rebuilds its buckets after the first step"
            )
    return found


def algorithm_of(name: str, topology) -> Callable[[dist.ProcessGroup], dist.ProcessGroup] | None:
    """``group -> the group the hook all-reduces over``; None for the backend's own all-reduce.
    Called on every rank in the same order (the hierarchical groups are a collective)."""
    if name == "ring":
        from plait.plugins.comm.ring import RingGroup

        return RingGroup
    if name != "hierarchical":
        return None
    from plait.plugins.comm.hierarchical import HierarchicalGroup

    # gradients are averaged over the data- and context-parallel ranks together
    nodes = topology.node_groups("dp_cp")
    dp_ranks = dist.get_process_group_ranks(topology.group("dp_cp"))
    if nodes.intra is None or nodes.inter is None:
        if topology.dp_cp_rank == 0 and topology.tp_rank == 0:
            where = (
                "lies on one node"
                if nodes.nnodes == 1
                else "has one rank per node"
                if nodes.local_size == 1
                else "is spread unevenly over the nodes"
            )
            print(
                f"plait: comm=hierarchical: data-parallel group {dp_ranks} {where}; "
                "falling back to flat all-reduce",
                flush=True,
            )
        return None

    def on_nodes(group: dist.ProcessGroup) -> dist.ProcessGroup:
        if dist.get_process_group_ranks(group) != dp_ranks:
            raise ValueError(
                "comm=hierarchical splits the data-parallel group by node: reduce "
                "over topology.group('dp_cp')"
            )
        return HierarchicalGroup(group, nodes.intra, nodes.inter)

    return on_nodes


class CommPlugin:
    """One of the two comm plugins; they differ in what they select and require."""

    def __init__(self, name: str, algorithms: tuple[str, ...], requires: dict, description: str):
        self.info = PluginInfo(
            name=name,
            selected_by={"comm.name": algorithms},
            requires=requires,
            description=description,
        )

    @hookimpl
    def plait_declare(self) -> PluginInfo:
        return self.info

    @hookimpl
    def plait_register_configs(self, config_store) -> None:
        config_store.store(group="comm", name="base_reducer", node=CommSettings)

    @hookimpl
    def plait_validate(self, cfg) -> list[str]:
        return problems(cfg)

    @hookimpl
    def plait_comm_spec(self, cfg) -> CommSpec:
        return comm_spec(cfg)

    @hookimpl
    def plait_grad_reducer(self, cfg, topology):
        from plait.plugins.comm.reducer import Reducer, compression_of

        spec, settings = comm_spec(cfg), cfg.comm
        compress = compression_of(
            spec, settings.powersgd_rank, settings.powersgd_start_iter, cfg.seed
        )
        return Reducer(spec, compress, algorithm_of(spec.algorithm, topology))


allreduce = CommPlugin(
    "allreduce",
    ("allreduce",),
    {},
    "the strategy's own all-reduce of gradients (+ compression, bucket size)",
)
comm = CommPlugin(
    "comm",
    ALGORITHMS,  # gradients are reduced over dp x cp
    {axis: frozenset({"engine:grad_comm"}) for axis in ("dp", "cp")},
    "explicit flat / ring / hierarchical all-reduce (+ compression, bucket size)",
)
