"""Shard a model with ``fully_shard`` and give each rank only its shards' memory and values.

On a model built on the meta device (:mod:`plait.meta`), FSDP2 shards the meta parameters (every
parameter becomes a DTensor, ``Shard(0)`` over the dp mesh), ``to_empty`` allocates this rank's
shards only, and each is filled from plait's initial value of the parameter: the box of the
(tensor-parallel) parameter FSDP's placement gives this rank (DTensor's
``compute_local_shape_and_global_offset``), read alone by a model that reads its values (a
pretrained checkpoint), otherwise cut from the full value made one parameter at a time. No
communication. Buffers (a rotary embedding's ``inv_freq``) keep their values across
``to_empty``. A model built whole is sharded as it is. Either way the parameters lose the
attributes plait's tensor-parallel layers set on them; they are carried over by name.

Under pipeline stages (``parallel.pp>1``) the model is this rank's
:class:`~plait.engine.stages.PipelineStageModules`: each of its stage chunks is sharded
as a model of its own (its layers, then the chunk, which takes the stage's embedding or head),
as torchtitan shards each model part, so torch's ``PipelineStage`` sees an ``FSDPModule`` and
syncs its gradients on the last micro-batch only. The chunks share their parts with the
stage modules, which therefore hold the same DTensors under the unsplit names.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from plait.engine.stages import PipelineStageModules
from plait.host_memory import return_freed_memory
from plait.meta import ParameterInit

# carried over the parameters fully_shard replaces: tensor-parallel shards' and experts' marks
TENSOR_PARALLEL_ATTRS = (
    "tensor_model_parallel",
    "partition_dim",
    "partition_stride",
    "allreduce",
    "group_name",
)


def dp_mesh(cfg, topology):
    """The data-parallel mesh: 1-D, or under ``strategy.replicate=R`` 2-D ``(replicate, shard)``
    with the shard groups of ``dp/R`` consecutive dp ranks (HSDP). With context parallelism the
    1-D mesh is the ``dp x cp`` ranks (torchtitan's ``dp_shard_cp``): they hold the same
    parameters and average their gradients. Where the replica groups run as independent torch
    jobs (``topology.dims.replica_groups > 1``) this group's ranks are one replica: no
    replicate dimension (the groups' own layer averages across them)."""
    replicate = cfg.strategy.replicate if topology.dims.replica_groups == 1 else 1
    if replicate == 1:
        return topology.dp_cp_mesh()
    dims = topology.dims
    return topology.mesh._unflatten(
        "dp", (replicate, dims.dp // replicate), ("replicate", "shard")
    )["replicate", "shard"]


def expert_data_parallel_mesh(topology):
    """The ranks holding the same experts: the dp mesh unflattened into ``(edp, ep)``, ep
    innermost (``plait.topology``'s layout), its ``edp`` axis."""
    dims = topology.dims
    return topology.mesh._unflatten("dp", (dims.edp, dims.ep), ("edp", "ep"))["edp"]


def expert_units(model: nn.Module) -> list[nn.Module]:
    """Each expert of every MoE layer this rank holds (expert parallelism): its own FSDP unit
    over the expert-data-parallel mesh, as torchtitan shards experts; the dispatcher calls each
    expert, so each gathers its parameters when it runs."""
    return [
        expert
        for m in model.modules()
        if getattr(m, "is_moe_layer", False)
        for expert in m.experts.values()
    ]


def mixed_precision(cfg):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if cfg.precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def units(model: nn.Module) -> list[nn.Module]:
    """The FSDP units: each layer of the model's layer list (named by its ``pipeline_plan``:
    plait's GPT's ``blocks``, a transformers model's decoder layers), then the root, which takes
    every parameter left (embeddings, final norm, head)."""
    plan = getattr(model, "pipeline_plan", None)
    layers = model.get_submodule(plan["layers"]) if plan else None
    if isinstance(layers, (nn.ModuleList, nn.ModuleDict)):  # a stage's: the layers it holds
        return [*layers.children(), model]
    return [model]


def stage_roots(model: nn.Module) -> list[nn.Module]:
    """The modules sharded as FSDP roots: each pipeline stage chunk this rank runs (a
    pipeline schedule calls each alone), else the model itself."""
    if isinstance(model, PipelineStageModules):
        return [chunk for _, chunk in model.chunks]
    return [model]


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return all(isinstance(root, FSDPModule) for root in stage_roots(model))


def tensor_parallel_attrs(model: nn.Module) -> dict[str, dict]:
    return {
        name: {a: getattr(p, a) for a in TENSOR_PARALLEL_ATTRS if hasattr(p, a)}
        for name, p in model.named_parameters()
    }


def restore(model: nn.Module, attrs: dict[str, dict]) -> nn.Module:
    """Put the tensor-parallel attributes back on the (replaced) parameters, by name."""
    for name, p in model.named_parameters():
        for attr, value in attrs.get(name, {}).items():
            setattr(p, attr, value)
    return model


def shard(cfg, model: nn.Module, topology) -> nn.Module:
    """``fully_shard`` every unit of every stage root (:func:`stage_roots`) over the dp mesh,
    reductions summed then divided (gloo).
    Under expert parallelism each expert first over the expert-data-parallel mesh, its
    gradients summed there and divided by dp too: ``g = Σ_edp g / dp``. On a mesh of one rank
    (``ep == dp``) torch 2.13 divides a gradient by the factor twice (``foreach_reduce``'s
    single-rank copy, then its post-divide), so there no factor is set and the engine divides
    (:func:`experts_divided_by_engine`)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    attrs = tensor_parallel_attrs(model)
    offload = CPUOffloadPolicy() if cfg.strategy.offload == "cpu" else OffloadPolicy()
    mesh = dp_mesh(cfg, topology)
    experts = expert_units(model) if topology.dims.ep > 1 else []
    edp_mesh = expert_data_parallel_mesh(topology) if experts else None
    plan = [(expert, edp_mesh) for expert in experts]
    plan += [(unit, mesh) for root in stage_roots(model) for unit in units(root)]
    # None: torch's own rule, what a plain fully_shard user gets: every unit reshards after its
    # forward except the root, whose parameters (embedding, final norm, head) the backward needs
    # first (it prefetches them at once: freeing them only bought an all-gather per step)
    reshard = None if cfg.strategy.reshard_after_forward else False
    for unit, unit_mesh in plan:
        fully_shard(
            unit,
            mesh=unit_mesh,
            reshard_after_forward=reshard,
            mp_policy=mixed_precision(cfg),
            offload_policy=offload,
        )
        unit.set_force_sum_reduction_for_comms(True)  # gloo's AVG is wrong (pytorch#162338)
        if unit_mesh.size() > 1 or topology.dims.dp_cp == 1:
            unit.set_gradient_divide_factor(float(topology.dims.dp_cp))
    return restore(model, attrs)


def experts_divided_by_engine(topology) -> bool:
    """Expert gradients are left undivided by FSDP (their mesh has one rank, see
    :func:`shard`): the engine divides them by dp."""
    return topology.dims.ep > 1 and topology.dims.edp == 1


def local_box(p) -> tuple[slice, ...]:
    """Where this rank's shard of the DTensor ``p`` sits in the whole parameter."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))


def shard_and_materialize(cfg, model: nn.Module, init: ParameterInit, topology) -> nn.Module:
    cuts = {name: p for name, p in model.named_parameters()}  # meta: shapes, slice_of_full
    shard(cfg, model, topology)
    device = "cpu" if cfg.strategy.offload == "cpu" else topology.device
    attrs = tensor_parallel_attrs(model)  # to_empty replaces the parameters again
    for root in stage_roots(model):  # an FSDP root re-registers its shards after to_empty
        buffers = {name: b.clone() for name, b in root.named_buffers()}  # to_empty drops values
        root.to_empty(device=device)
        with torch.no_grad():
            for name, b in root.named_buffers():
                b.copy_(buffers.pop(name))
    restore(model, attrs)
    with torch.no_grad():
        for name, p in model.named_parameters():
            local = p.to_local()
            if local.numel():
                local.copy_(init.part(name, cuts[name], local_box(p)).view_as(local))
            if torch.device(device).type == "cpu":
                return_freed_memory()
    return model
