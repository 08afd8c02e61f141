"""The layout-free copy of a checkpoint: model and optimizer state keyed by the unsplit model's
parameter names, as full tensors, in PyTorch Distributed Checkpoint (DCP) format, so a
checkpoint written at one layout (dp, tp, pp, ddp or ZeRO stage) loads at any other.

An engine that can be resharded offers two methods (capability ``engine:layout_free_state``)::

    layout_free_state() -> {"model": {fqn: tensor}, "optim": {fqn: {key: tensor}},
                            "loss_scale": {"scale", "growth_tracker", "skipped_steps", ...}}
    load_layout_free_state(state)            # the same structure, this rank's tensors

(``loss_scale`` only where a dynamic fp16 loss scaler runs: DDP's and the pipeline's torch
``GradScaler``, DeepSpeed's scaler; 0-d tensors, the same on every rank, so a resume under any
layout scales the loss as the run that saved would have. A resume without one starts a fresh
scaler; a scaler entry the checkpoint lacks, such as DeepSpeed's ``hysteresis`` after torch's
scaler, keeps the loading engine's own value.)

holding this rank's parameters under the unsplit model's names (a pipeline stage: its own
names), full over data parallelism (ZeRO's partitions joined) but still this rank's
tensor-parallel shard. An engine may offer the same structure without joining anything
(issue 32: gathering cost every rank the whole model's states at a save)::

    layout_free_shards() -> the same, each tensor as this rank holds it: whole, a DTensor (its
                            dp shards), or plait.engine.pieces.Pieces (ZeRO's flat partitions),
                            every one a view of the engine's own memory
    load_layout_free_shards(state)  # that structure after DCP filled it in place

and is then saved and loaded from its pieces (:mod:`plait.engine.pieces`), each placed where it
sits in the unsplit tensor, tensor-parallel shards too: no rank holds more than it trains with.
A background save (``checkpoint.async_save``) copies the same pieces to CPU memory (DCP's
stager), so its copy too is of this rank's own shards. This module turns tensor-parallel shards
into full tensors and back, using the placement every shard carries (Megatron's attributes
``partition_dim`` and ``partition_stride`` on the parameter), and hands the result to
``dcp.save`` / ``dcp.load``.
Replicated entries (the same key on several ranks: dp replicas, tp-replicated parameters) are
written once by DCP's planner; a rank loads only the keys it holds, so pipeline stages read
their own parameters.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from plait.engine.pieces import Pieces, load_planner, place_tensor_parallel, save_planner
from plait.engine.tensor_shards import merge_tensors, split_tensor

# torch.distributed.checkpoint is imported where it is used: it pulls in DTensor and sympy
# (~0.8 s), and every ``plait train`` loads the plugins that import this in the launching
# process too.

DIRECTORY = "layout_free"
SHARD_ATTRS = ("partition_dim", "partition_stride")


def tensor_parallel_placements(engine) -> dict[str, tuple[int, int]]:
    """``{fqn: (dim, parts)}`` of the engine's tensor-parallel shards, under every name of a
    shared (tied) parameter."""
    return {
        name: (p.partition_dim, p.partition_stride)
        for name, p in engine.model.named_parameters(remove_duplicate=False)
        if getattr(p, "tensor_model_parallel", False)
    }


def _map_entries(state: dict, placements: dict[str, tuple[int, int]], fn) -> dict:
    """Apply ``fn(tensor, (dim, parts))`` to every entry of a sharded parameter of ``state``;
    other entries (replicated parameters, scalars such as Adam's step, the loss scale) pass
    through."""
    out: dict[str, Any] = {**state, "model": {}, "optim": {}}
    for name, value in state["model"].items():
        out["model"][name] = fn(value, placements[name]) if name in placements else value
    for name, entries in state["optim"].items():
        out["optim"][name] = {
            key: fn(v, placements[name]) if name in placements and v.dim() > 0 else v
            for key, v in entries.items()
        }
    return out


def gather_shard(local: torch.Tensor, placement: tuple[int, int], topology) -> torch.Tensor:
    """The full tensor of a tensor-parallel shard, from every tp rank (a collective over the
    tp group)."""
    shards = [torch.empty_like(local) for _ in range(topology.dims.tp)]
    dist.all_gather(shards, local.contiguous(), group=topology.group("tp"))
    return merge_tensors(shards, *placement)


def full_state(engine, topology) -> dict:
    """The engine's layout-free state with every tensor-parallel shard joined over the tp group
    (a collective on every rank)."""
    placements = tensor_parallel_placements(engine)
    state = engine.layout_free_state()
    if not placements:
        return state
    return _map_entries(
        state, placements, lambda local, placement: gather_shard(local, placement, topology)
    )


def local_state(engine, topology, full: dict) -> dict:
    """``full`` cut back into this rank's tensor-parallel shards."""
    placements = tensor_parallel_placements(engine)
    if not placements:
        return full
    rank, size = topology.tp_rank, topology.dims.tp
    return _map_entries(
        full,
        placements,
        lambda t, placement: split_tensor(t, placement[0], placement[1], rank, size),
    )


def writes_pieces(engine) -> bool:
    """The engine hands over its state as the pieces it holds (``layout_free_shards``)."""
    return hasattr(engine, "layout_free_shards")


def pieces_state(engine, topology, shards: dict) -> dict:
    """``shards`` (an engine's ``layout_free_shards()``) with every sharded entry as
    :class:`~plait.engine.pieces.Pieces` of the unsplit tensor: views of the engine's memory,
    nothing gathered. Whole tensors without a tensor-parallel placement pass through."""
    placements = tensor_parallel_placements(engine)
    rank, size = topology.tp_rank, topology.dims.tp

    def place(name: str, value):
        if not isinstance(value, (torch.Tensor, Pieces)) or (
            isinstance(value, torch.Tensor) and value.dim() == 0
        ):
            return value  # a scalar (Adam's step): the same on every rank
        return place_tensor_parallel(value, placements.get(name), rank, size)

    out: dict[str, Any] = {**shards}
    out["model"] = {name: place(name, v) for name, v in shards["model"].items()}
    out["optim"] = {
        name: {key: place(name, v) for key, v in entries.items()}
        for name, entries in shards["optim"].items()
    }
    return out


def save(engine, topology, directory: Path, group, stager=None):
    """Write the layout-free state into ``directory/layout_free``. With ``stager`` the state is
    copied to CPU memory and written in the background (``dcp.async_save``): the result is the
    future of the write; without, the write is done when this returns (None). An engine that
    hands over its pieces (:func:`writes_pieces`) is written from them, nothing gathered: in
    place, or in the background from the stager's copy of the pieces."""
    import torch.distributed.checkpoint as dcp

    target = directory / DIRECTORY
    if writes_pieces(engine):
        state = pieces_state(engine, topology, engine.layout_free_shards())
        planner = save_planner()
    else:
        state, planner = full_state(engine, topology), None
    if stager is None:
        dcp.save(state, checkpoint_id=target, process_group=group, planner=planner)
        return None
    response = dcp.async_save(
        state, checkpoint_id=target, process_group=group, async_stager=stager, planner=planner
    )
    return getattr(response, "upload_completion", response)


def load(engine, topology, directory: Path, group) -> None:
    """Read ``directory/layout_free`` into the engine, whatever layout wrote it: the engine's own
    state (full tensors) is the template DCP fills in place."""
    import torch.distributed.checkpoint as dcp

    reader = dcp.FileSystemReader(str(directory / DIRECTORY))
    stored = reader.read_metadata().state_dict_metadata
    shards = engine.layout_free_shards() if writes_pieces(engine) else None
    template = (
        full_state(engine, topology) if shards is None else pieces_state(engine, topology, shards)
    )
    scaler = {
        k: v for k, v in template.pop("loss_scale", {}).items() if f"loss_scale.{k}" in stored
    }  # what the saving run's scaler wrote, if any
    if scaler:
        template["loss_scale"] = scaler
    if shards is None:
        dcp.load(template, storage_reader=reader, process_group=group)
        engine.load_layout_free_state(local_state(engine, topology, template))
        return
    dcp.load(template, storage_reader=reader, process_group=group, planner=load_planner())
    if scaler:  # read into fresh tensors; the rest was read into the engine's own, in place
        shards["loss_scale"] = template["loss_scale"]
    else:
        shards.pop("loss_scale", None)
    engine.load_layout_free_shards(shards)


def saved_shapes(directory: Path) -> dict[str, tuple[int, ...]]:
    """The model entries of a layout-free checkpoint and their full shapes, read from DCP's
    metadata alone (no tensor is loaded)."""
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(str(directory / DIRECTORY)).read_metadata()
    return {
        key.removeprefix("model."): tuple(meta.size)
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith("model.") and hasattr(meta, "size")
    }


def read_model(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The model of a checkpoint's layout-free copy, every tensor whole (dp and tp shards joined,
    every pipeline stage's names), in fp32, read offline: one process, no process group
    (``plait export``, ``plait sample``). The entries DCP's metadata lists under ``model.`` are
    allocated and ``dcp.load`` fills them; the optimizer's are not read."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(checkpoint / DIRECTORY))
    stored = reader.read_metadata().state_dict_metadata
    model = {
        key.removeprefix("model."): torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in stored.items()
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)
    }
    dcp.load({"model": model}, storage_reader=reader, no_dist=True)
    return {name: value.float() for name, value in model.items()}
