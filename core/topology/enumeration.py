"""The global ranks of every group, enumerated without processes (what ``plait plan`` prints and
the mesh builds): the ``(pp, dp, cp, tp)`` mesh's groups along an axis, the expert-parallel
groups carved out of dp, and a group's split into nodes."""

from __future__ import annotations

import torch

from plait.topology.dims import ParallelDims

MESH_AXES = ("pp", "dp", "cp", "tp")


def mesh_shape(dims: ParallelDims) -> tuple[int, int, int, int]:
    return (dims.pp, dims.dp, dims.cp, dims.tp)


def mesh_groups(dims: ParallelDims, axis: str, ranks: list[int] | None = None) -> list[list[int]]:
    """The global ranks of every group along ``axis`` of the ``(pp, dp, cp, tp)`` mesh, the
    layout ``init_device_mesh`` builds (the same enumeration ``plait plan`` prints without
    processes); ``axis="dp_cp"``: the data- and context-parallel ranks together. ``ranks``: the
    global ranks the mesh is laid over, in order (the trainers); default all."""
    ranks = list(range(dims.world_size)) if ranks is None else ranks
    mesh = torch.tensor(ranks).reshape(mesh_shape(dims))
    if axis == "dp_cp":
        return mesh.movedim(3, 1).reshape(-1, dims.dp * dims.cp).tolist()
    dim = MESH_AXES.index(axis)
    return mesh.movedim(dim, -1).reshape(-1, mesh.shape[dim]).tolist()


def expert_groups(
    dims: ParallelDims, ranks: list[int] | None = None
) -> tuple[list[list[int]], list[list[int]]]:
    """The expert-parallel and expert-data-parallel groups (global ranks): each dp group cut into
    runs of ``ep`` consecutive dp ranks, and the ranks at the same place in each run."""
    ep_groups, edp_groups = [], []
    for group in mesh_groups(dims, "dp", ranks):
        runs = [group[i : i + dims.ep] for i in range(0, dims.dp, dims.ep)]
        ep_groups += runs
        edp_groups += [list(peers) for peers in zip(*runs)]
    return ep_groups, edp_groups


def split_by_node(ranks: list[int], node_of: list[int]) -> list[list[int]] | None:
    """One group's ranks in their per-node parts (group order kept), or None when the nodes hold
    different numbers of them (no hierarchical scheme then)."""
    parts: dict[int, list[int]] = {}
    for rank in ranks:
        parts.setdefault(node_of[rank], []).append(rank)
    if len({len(part) for part in parts.values()}) > 1:
        return None
    return list(parts.values())


def node_enumeration(groups: list[list[int]], node_of: list[int]) -> tuple[list, list]:
    """The intra-node and inter-node subgroups of every group, for
    ``new_subgroups_by_enumeration``: intra = a group's ranks on one node; inter = one rank per
    node, those at the same position within their node's part. Parts of one rank are left out."""
    intra, inter = [], []
    for ranks in groups:
        parts = split_by_node(ranks, node_of)
        if parts is None or len(parts) == 1 or len(parts[0]) == 1:
            continue
        intra += parts
        inter += [list(peers) for peers in zip(*parts)]
    return intra, inter
