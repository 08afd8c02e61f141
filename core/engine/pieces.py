"""A tensor as the pieces this rank holds of it, each where it sits in the whole: what the
layout-free checkpoint writes and reads without gathering anything (issue 32).

A rank under FSDP, ZeRO or tensor parallelism holds parts of each parameter and optimizer
state. Gathering them into whole tensors to save them costs every rank the whole model's states
at once (a 1B-parameter GPT under fsdp on 4 processes was OOM-killed at its end-of-run save).
DCP does not need whole tensors: a checkpoint entry is a set of chunks, each a box (offsets and
sizes) of the whole tensor, written by whichever rank holds it, and a reader at any layout reads
the boxes that overlap its own. So each rank hands DCP its own pieces as views of its memory:

- a plain tensor the rank holds whole (DDP, ZeRO-1/2's parameters): one piece, the tensor;
- a DTensor (FSDP's shards): its local tensor at the offset its placements give;
- a flat slice ``[start, start + n)`` of a tensor (ZeRO's partitions): up to ``2·ndim - 1``
  boxes (a partial row, whole rows, a partial row; recursively), :func:`flat_pieces`;
- a tensor-parallel shard (Megatron's ``partition_dim`` and ``partition_stride``, see
  :mod:`plait.engine.tensor_shards`): each piece cut at the stride's block boundaries and moved
  to where the block sits in the unsplit tensor, :func:`place_tensor_parallel`.

:class:`Pieces` speaks DCP's checkpointable protocol (``__create_write_items__``,
``__create_chunk_list__``, ``__get_tensor_shard__``, the one DTensor uses); the planners below
find a piece by its offsets. Loaded in place, the pieces fill the engine's own tensors.
"""

from __future__ import annotations

import math
from typing import Any

import torch

Box = tuple[tuple[int, ...], torch.Tensor]  # (offsets in the whole tensor, this rank's view)


class Pieces:
    """The pieces this rank holds of a tensor of ``shape``: ``boxes``, each (offsets, view)."""

    def __init__(self, shape: tuple[int, ...], boxes: list[Box]):
        self.shape = tuple(shape)
        self.boxes = [(tuple(o), t) for o, t in boxes if t.numel()]

    def __repr__(self) -> str:
        return f"Pieces(shape={self.shape}, boxes={[(o, tuple(t.shape)) for o, t in self.boxes]})"

    # -- DCP's protocol -------------------------------------------------------------------------

    def __create_write_items__(self, fqn: str, obj: Any) -> list:
        from torch.distributed.checkpoint.metadata import (
            ChunkStorageMetadata,
            MetadataIndex,
            TensorProperties,
        )
        from torch.distributed.checkpoint.planner import (
            TensorWriteData,
            WriteItem,
            WriteItemType,
        )

        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=t.size()),
                    properties=TensorProperties.create_from_tensor(t),
                    size=torch.Size(self.shape),
                ),
            )
            for offsets, t in self.boxes
        ]

    def __create_chunk_list__(self) -> list:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=t.size()) for o, t in self.boxes]

    def __get_tensor_shard__(self, index) -> torch.Tensor:
        for offsets, t in self.boxes:
            if torch.Size(offsets) == index.offset:
                return t
        raise ValueError(f"{index.fqn}: no piece at {tuple(index.offset)} on this rank")


def flat_pieces(shape: tuple[int, ...], start: int, flat: torch.Tensor) -> list[Box]:
    """The boxes of a tensor of ``shape`` (row-major) that elements ``[start, start + n)`` are,
    ``flat`` (1-D, n elements) holding them; each box a view of ``flat``."""
    shape = tuple(shape)
    if not shape:
        return [((), flat.view(()))] if flat.numel() else []
    boxes: list[Box] = []

    def cut(dims: tuple[int, ...], prefix: tuple[int, ...], lo: int, hi: int, at: int) -> None:
        """Elements [lo, hi) of a sub-tensor of ``dims`` at ``prefix``, read from flat[at:]."""
        if lo >= hi:
            return
        lead = len(prefix)

        def add(offsets: tuple[int, ...], sizes: tuple[int, ...], begin: int) -> None:
            view = flat[begin : begin + math.prod(sizes)].view(sizes)
            boxes.append(((*prefix, *offsets), view.view((1,) * lead + tuple(sizes))))

        if len(dims) == 1:
            add((lo,), (hi - lo,), at)
            return
        row = math.prod(dims[1:])
        first, last = -(-lo // row), hi // row  # whole rows [first, last)
        if first > last:  # within one row
            r = lo // row
            cut(dims[1:], (*prefix, r), lo - r * row, hi - r * row, at)
            return
        if lo < first * row:
            r = first - 1
            cut(dims[1:], (*prefix, r), lo - r * row, row, at)
        if first < last:
            add((first, *(0,) * (len(dims) - 1)), (last - first, *dims[1:]), at + first * row - lo)
        if last * row < hi:
            cut(dims[1:], (*prefix, last), 0, hi - last * row, at + last * row - lo)

    cut(shape, (), start, start + flat.numel(), 0)
    return boxes


def boxes_of(value: Any) -> tuple[tuple[int, ...], list[Box]]:
    """The whole shape and this rank's boxes of a tensor, a DTensor or :class:`Pieces`."""
    if isinstance(value, Pieces):
        return value.shape, value.boxes
    local = getattr(value, "to_local", None)
    if local is not None:  # a DTensor: its local shard at its offset
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, offsets = compute_local_shape_and_global_offset(
            value.shape, value.device_mesh, value.placements
        )
        return tuple(value.shape), [(tuple(offsets), local())]
    return tuple(value.shape), [((0,) * value.dim(), value)]


def place_tensor_parallel(
    value: Any, placement: tuple[int, int] | None, tp_rank: int, tp_size: int
) -> Any:
    """``value`` (this rank's tensor-parallel shard, whole or in pieces) as pieces of the unsplit
    tensor; a plain tensor without ``placement`` is returned as it is."""
    if placement is None and isinstance(value, torch.Tensor) and not hasattr(value, "to_local"):
        return value
    shape, boxes = boxes_of(value)
    if placement is None:
        return Pieces(shape, boxes)
    dim, parts = placement
    block = shape[dim] // parts  # one block of the shard along dim
    whole = list(shape)
    whole[dim] *= tp_size
    placed: list[Box] = []
    for offsets, t in boxes:
        lo, hi = offsets[dim], offsets[dim] + t.shape[dim]
        while lo < hi:
            j = lo // block
            end = min(hi, (j + 1) * block)
            moved = list(offsets)
            moved[dim] = j * block * tp_size + tp_rank * block + (lo - j * block)
            placed.append((tuple(moved), t.narrow(dim, lo - offsets[dim], end - lo)))
            lo = end
    return Pieces(tuple(whole), placed)


def save_planner():
    """DCP's default save planner, finding a :class:`Pieces` entry's piece by its offsets."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    from plait.host_memory import return_freed_memory

    class PiecesSavePlanner(DefaultSavePlanner):
        written: torch.Tensor | None = None  # the last copy handed to the writer

        def resolve_data(self, write_item):
            """DCP's writer copies each piece that is a view of a larger buffer (ZeRO's flat
            partitions) before it writes it, and keeps every copy until the rank's file is
            done (pytorch/pytorch#195982: kept for its safetensors format only): a ZeRO-3
            save's peak read 1.05x training's. On the CPU the writer resolves and writes one
            item at a time, so the copy is made here instead and emptied when the writer asks
            for the next item; what allocators keep of freed memory goes back first."""
            if self.written is not None:
                self.written.untyped_storage().resize_(0)
                self.written = None
            return_freed_memory()
            data = super().resolve_data(write_item)
            if (
                isinstance(data, torch.Tensor)
                and data.untyped_storage().nbytes() != data.nbytes
                and writes_one_at_a_time(data)
            ):
                data = self.written = data.clone()
            return data

        def lookup_object(self, index):
            value = self.state_dict[index.fqn]
            if isinstance(value, Pieces):
                return value.__get_tensor_shard__(index)
            return super().lookup_object(index)

    return PiecesSavePlanner()


def writes_one_at_a_time(data: torch.Tensor) -> bool:
    """Whether DCP's file writer resolves ``data``'s item only after writing the one before:
    its serial loader, which it uses for CPU tensors unless an accelerator is present (then it
    resolves ahead, ``_OverlappingCpuLoader``), in one thread (plait's saves take DCP's default
    writer, ``thread_count=1``: threads of their own would share the planner's last copy)."""
    accelerator = torch._C._get_privateuse1_backend_name()
    module = getattr(torch, accelerator, None)
    return data.is_cpu and not (
        torch.cuda.is_available() or (module is not None and module.is_available())
    )


def load_planner():
    """DCP's default load planner, reading into a :class:`Pieces` entry's piece in place."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class PiecesLoadPlanner(DefaultLoadPlanner):
        def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
            """DCP's set-up replaces what is not a tensor, a number or a string by None while
            it looks for meta tensors: the pieces stand aside meanwhile (0 in their place)."""
            aside: dict[tuple, Pieces] = {}

            def put_aside(d: dict, path: tuple) -> None:
                for key, value in d.items():
                    if isinstance(value, Pieces):
                        aside[path + (key,)], d[key] = value, 0
                    elif isinstance(value, dict):
                        put_aside(value, (*path, key))

            put_aside(state_dict, ())
            super().set_up_planner(state_dict, metadata, is_coordinator)
            flat_key = {tuple(path): key for key, path in (self.mappings or {}).items()}
            for path, value in aside.items():
                parent = state_dict
                for key in path[:-1]:
                    parent = parent[key]
                parent[path[-1]] = value
                self.state_dict[flat_key.get(path, path[-1])] = value

        def lookup_tensor(self, index):
            value = self.state_dict[index.fqn]
            if isinstance(value, Pieces):
                return value.__get_tensor_shard__(index)
            return super().lookup_tensor(index)

    return PiecesLoadPlanner()
