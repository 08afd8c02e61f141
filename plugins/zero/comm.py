"""The comm plugin's choice under DeepSpeed, which reduces gradients itself and has no comm-hook
API: each part of the :class:`~plait.types.CommSpec` maps onto DeepSpeed's own setting where one
exists, and is refused before launch where none does.

    comm.compression=fp16|bf16   communication_data_type: fp16|bf16 (gradients cast for the
                                 reduce; DeepSpeed's twin of torch's fp16/bf16 compress hooks)
    comm.bucket_mb=B             zero_optimization.reduce_bucket_size: B MiB in elements of the
                                 communicated dtype (DeepSpeed counts elements, not bytes)
    comm=hierarchical, ZeRO-3    zero_optimization.zero_hpz_partition_size: processes per node
                                 (ZeRO++'s hpZ: a secondary copy of the parameter shards inside
                                 each node, so the backward all-gathers never cross nodes; on one
                                 node there is nothing to map)
    comm=allreduce               DeepSpeed's own reduce-scatter / all-reduce: nothing to set

Refused: ``comm=flat`` and ``comm=ring`` (plait's reducers, which DeepSpeed cannot call),
``comm=hierarchical`` below ZeRO-3 or with tensor parallelism (hpZ groups consecutive global
ranks), ``comm.compression=powersgd`` (DeepSpeed has no PowerSGD).
"""

from __future__ import annotations

from typing import Any

from plait.plugin_manager import offered_by
from plait.types import CommSpec

CAST = ("fp16", "bf16")
REDUCER_TAKERS = "engine:grad_reducer"  # strategies whose engine calls plait's reducers


def comm_settings(
    spec: CommSpec | None, cfg, stage: int, nnodes: int, tp: int
) -> tuple[dict[str, Any], dict[str, str], list[str]]:
    """``(DeepSpeed settings, the comm choice behind each DeepSpeed key, problems)``."""
    settings: dict[str, Any] = {}
    zero: dict[str, Any] = {}
    owners: dict[str, str] = {}
    problems: list[str] = []
    if spec is None:
        return settings, owners, problems
    strategy = f"strategy={cfg.strategy.name}"
    if spec.compression in CAST:
        settings["communication_data_type"] = spec.compression
        owners["communication_data_type"] = f"comm.compression={spec.compression}"
    elif spec.compression != "none":
        problems.append(
            f"comm.compression={spec.compression} under {strategy}: DeepSpeed has no "
            f"such gradient compression (its own is communication_data_type); use "
            f"comm.compression=fp16|bf16|none, or {offered_by(REDUCER_TAKERS)}"
        )
    if spec.bucket_bytes is not None:
        itemsize = 2 if spec.compression in CAST or cfg.precision != "fp32" else 4
        zero["reduce_bucket_size"] = spec.bucket_bytes // itemsize
        owners["zero_optimization.reduce_bucket_size"] = (
            f"comm.bucket_mb={spec.bucket_bytes / 2**20:g} ({itemsize}-byte elements)"
        )
    if spec.algorithm == "hierarchical":
        if stage != 3:
            problems.append(
                f"comm=hierarchical under {strategy}: DeepSpeed's hierarchical scheme "
                "is ZeRO++'s hpZ (zero_hpz_partition_size), for ZeRO-3 only; use "
                "strategy=zero3, or comm=allreduce"
            )
        elif tp > 1:
            problems.append(
                f"comm=hierarchical under {strategy} with parallel.tp={tp}: "
                "DeepSpeed's hpZ groups consecutive global ranks, which would mix "
                "tensor-parallel shards; use parallel.tp=1 or comm=allreduce"
            )
        elif nnodes > 1:
            zero["zero_hpz_partition_size"] = cfg.launcher.nproc_per_node
            owners["zero_optimization.zero_hpz_partition_size"] = (
                "comm=hierarchical (processes per node)"
            )
    elif not spec.native:
        problems.append(
            f"comm={spec.algorithm} under {strategy}: DeepSpeed reduces gradients "
            "with its own collectives and cannot call a plait reducer; use "
            "comm=allreduce (with comm.compression / comm.bucket_mb), or "
            f"{offered_by(REDUCER_TAKERS)}"
        )
    if zero:
        settings["zero_optimization"] = zero
    return settings, owners, problems
