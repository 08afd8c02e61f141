"""The layout as text, for ``plait plan`` and the start-up log."""

from __future__ import annotations

from typing import TYPE_CHECKING

from plait.topology.dims import ParallelDims
from plait.topology.enumeration import mesh_groups, node_enumeration, split_by_node
from plait.topology.roles import TRAINER, Roles

if TYPE_CHECKING:
    from plait.topology.mesh import Topology


def describe_node_split(ranks: list[int], node_of: list[int]) -> str:
    """``[0 2 | 4 6]``: a group's ranks, a bar between nodes (``uneven`` when not split evenly)."""
    parts = split_by_node(ranks, node_of)
    if parts is None:
        return f"{ranks} (uneven over nodes)"
    return "[" + " | ".join(" ".join(map(str, part)) for part in parts) + "]"


def describe_nodes(dims: ParallelDims, node_of: list[int], roles: Roles | None = None) -> list[str]:
    """The node layout, for ``plait plan`` and the start-up log: each node's ranks and how each
    data-parallel group splits into intra-node and inter-node groups."""
    everyone = describe_node_split(list(range(len(node_of))), node_of)
    lines = [f"nodes: {dims.nnodes}, ranks by node {everyone}"]
    if roles is not None and not roles.single:
        lines.append(
            "  roles: " + ", ".join(f"{role} {list(ranks)}" for role, ranks in roles.ranks.items())
        )
    if dims.dp > 1:
        groups = mesh_groups(dims, "dp", roles.trainers if roles else None)
        intra, inter = node_enumeration(groups, node_of)
        shown = ", ".join(describe_node_split(g, node_of) for g in groups[:4])
        more = f" (+{len(groups) - 4} more)" if len(groups) > 4 else ""
        lines.append(f"  dp groups by node: {shown}{more}")
        if intra:
            lines.append(f"  intra-node groups: {' '.join(map(str, intra))}")
            lines.append(f"  inter-node groups: {' '.join(map(str, inter))}")
        else:
            lines.append(
                "  no intra-/inter-node groups: each dp group lies on one node or has "
                "one rank per node"
            )
    return lines


def describe_rank(topology: Topology) -> str:
    """``rank 3/4 (node 1, local 1/2) pp=0/1 dp=1/2 tp=1/2 on cpu``: a rank's place."""
    d = topology.dims
    if topology.role != TRAINER:
        return (
            f"{topology.role} rank {topology.rank}/{len(topology.node_of)} (node "
            f"{topology.node_rank}, local {topology.local_rank}/{topology.local_world_size}) "
            f"on {topology.device}"
        )
    return (
        f"rank {topology.rank}/{d.world_size} (node {topology.node_rank}, local "
        f"{topology.local_rank}/{topology.local_world_size}) pp={topology.pp_rank}/{d.pp} "
        f"dp={topology.dp_rank}/{d.dp} "
        + (f"cp={topology.cp_rank}/{d.cp} " if d.cp > 1 else "")
        + f"tp={topology.tp_rank}/{d.tp}"
        + (f" ep={topology.ep_rank}/{d.ep}" if d.ep > 1 else "")
        + f" on {topology.device}"
        + (
            f" in replica group {topology.replica_group_id}/{d.replica_groups}"
            if d.replica_groups > 1
            else ""
        )
    )
