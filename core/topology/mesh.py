"""This rank's place in the mesh, the node it runs on, and the process groups: ``Topology``."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from plait.host_memory import DECOMMIT_ABOVE
from plait.topology.aliases import DeprecatedGroupNames
from plait.topology.describe import describe_rank
from plait.topology.device import pick_device
from plait.topology.dims import ParallelDims
from plait.topology.elastic import elastic_grad_accum_steps
from plait.topology.enumeration import (
    MESH_AXES,
    expert_groups,
    mesh_groups,
    mesh_shape,
    node_enumeration,
    split_by_node,
)
from plait.topology.launcher_env import launcher_node_env, replica_group_env, restart_safe_store
from plait.topology.one_rank import new_subgroup, one_rank_backend
from plait.topology.roles import Roles


@dataclass(frozen=True)
class NodeGroups:
    """One group split by node, for hierarchical collectives.

    ``intra`` holds this rank's peers on its own node, ``inter`` one peer per node (those at the
    same position within their node); either is None when it would hold this rank alone (the
    group lies on one node, or has one rank per node) or the nodes hold unequal shares.
    """

    nnodes: int
    local_size: int
    intra: dist.ProcessGroup | None
    inter: dist.ProcessGroup | None


@dataclass
class Topology(DeprecatedGroupNames):
    """This rank's place in the mesh, the node it runs on, and the process groups of each axis.

    Every group is named one way, ``group(name)`` (the mesh axes, ``dp_cp``, ``ep``, ``edp``,
    ``replica``), beside the groups made for a purpose (``node_groups``, ``side_group``,
    ``role_group``); a rank's place on an axis is ``<axis>_rank``.

    In a job whose replica groups run as independent torch jobs (``dims.replica_groups > 1``),
    the process group, the mesh and every size are this group's; ``replica_group_id`` says which
    group it is, :attr:`data_parallel_rank` where this rank's share of the global batch is, and
    ``quorum_rank`` the group's place in the step's quorum.
    """

    dims: ParallelDims
    device: torch.device
    mesh: dist.DeviceMesh
    rank: int
    local_rank: int
    node_rank: int
    local_world_size: int
    node_of: list[int]  # the node rank of every global rank, as the launcher assigned it
    roles: Roles = None  # type: ignore[assignment]  # None: every rank a trainer (__post_init__)
    # The core's and shared plugins' collectives run over these (None: the default group, as in
    # a plain run). trainer_group: start-up and checkpoints; step_group: per-step figures.
    trainer_group: dist.ProcessGroup | None = None
    step_group: dist.ProcessGroup | None = None
    # parallel.ep > 1: this rank's expert-parallel and expert-data-parallel groups
    ep_group: dist.ProcessGroup | None = None
    edp_group: dist.ProcessGroup | None = None
    replica_group_id: int = 0  # which replica group this torch job is (dims.replica_groups)
    # This group's place among the groups of the step's quorum (None: not in it), set each
    # step by the fault-tolerance plugin that runs the replica groups; the first writes the
    # run's checkpoints. 0 for a job that runs as one.
    quorum_rank: int | None = 0
    _node_groups: dict[str, NodeGroups] = field(default_factory=dict, repr=False)
    _dp_cp_mesh: dist.DeviceMesh | None = field(default=None, repr=False)
    _groups: dict[str, dist.ProcessGroup | None] = field(default_factory=dict, repr=False)

    @classmethod
    def initialize(cls, cfg, assign_roles: Callable[[int], Roles | None] | None = None) -> Topology:
        """Join the process group started by the launcher, learn the nodes, give each rank its
        role (``assign_roles(world_size)``, the strategy's answer), build the trainers' mesh."""
        node_rank, local_rank, local_world_size = launcher_node_env(dict(os.environ))
        replica_group, replica_groups = replica_group_env(dict(os.environ))
        device = pick_device(
            cfg.device,
            OmegaConf.select(cfg, "launcher.allocator", default="auto"),
            OmegaConf.select(cfg, "launcher.decommit_above", default=DECOMMIT_ABOVE),
        )
        if not dist.is_initialized():
            backend = "nccl" if device.type == "cuda" else "gloo"
            timeout = timedelta(seconds=cfg.launcher.timeout_s)
            store = restart_safe_store(timeout)
            if store is None:
                dist.init_process_group(backend, timeout=timeout)
            else:
                dist.init_process_group(
                    backend,
                    store=store,
                    rank=int(os.environ["RANK"]),
                    world_size=int(os.environ["WORLD_SIZE"]),
                    timeout=timeout,
                )
        world_size = dist.get_world_size()
        roles = Roles.resolve(assign_roles(world_size) if assign_roles else None, world_size)
        trainers = roles.trainers
        node_of = gather_node_ranks(node_rank, device)
        # the layout of every rank of the job, cut to this replica group's (1: the whole job)
        dims = ParallelDims.from_config(
            cfg, world_size=len(trainers) * replica_groups
        ).one_replica_group(replica_groups)
        # an elastic job keeps train.batch_size at this size by accumulating more or less
        dims = replace(
            dims,
            nnodes=len({node_of[r] for r in trainers}),
            grad_accum_steps=elastic_grad_accum_steps(cfg, dims, local_world_size),
        )
        groups = {}
        backends = axis_backends(dims, device)
        if roles.single:  # today's layout, untouched: the default group is the trainer group
            mesh = dist.init_device_mesh(
                device.type,
                mesh_shape(dims),
                mesh_dim_names=MESH_AXES,
                backend_override={axis: b for axis, b in zip(MESH_AXES, backends) if b},
            )
        else:  # every rank takes part in creating each group, members or not
            mesh = dist.DeviceMesh(
                device.type,
                torch.tensor(trainers).reshape(mesh_shape(dims)),
                mesh_dim_names=MESH_AXES,
                backend_override=tuple((b, None) for b in backends),
            )
            groups["trainer_group"] = groups["step_group"] = dist.new_group(trainers)
        if not roles.lockstep:
            groups["step_group"] = new_subgroup([[r] for r in trainers], device)
        if dims.ep > 1:  # every rank takes part in creating each group
            ep_ranks, edp_ranks = expert_groups(dims, trainers)
            groups["ep_group"] = new_subgroup(ep_ranks, device)
            groups["edp_group"] = new_subgroup(edp_ranks, device)
        return cls(
            dims=dims,
            device=device,
            mesh=mesh,
            rank=dist.get_rank(),
            local_rank=local_rank,
            node_rank=node_rank,
            local_world_size=local_world_size,
            node_of=node_of,
            roles=roles,
            replica_group_id=replica_group,
            **groups,
        )

    def __post_init__(self) -> None:
        if self.roles is None:
            self.roles = Roles.resolve(None, len(self.node_of))

    @property
    def role(self) -> str:
        return self.roles.role_of(self.rank)

    @property
    def trainer_ranks(self) -> list[int]:
        return self.roles.trainers

    @property
    def local_trainer_rank(self) -> int:
        """This trainer's place among the trainers on its node (its local rank in a plain run):
        0 does a node's one-off work, such as writing the token cache."""
        return [r for r in self.trainer_ranks if self.node_of[r] == self.node_rank].index(self.rank)

    def group(self, name: str) -> dist.ProcessGroup | None:
        """The process group ``name`` holds this rank in: a mesh axis (``"pp"``, ``"dp"``,
        ``"cp"``, ``"tp"``), ``"dp_cp"`` (data- and context-parallel ranks together, over which
        gradients and the loss are averaged), ``"ep"`` (the ranks holding other experts; None
        while ``ep == 1``), ``"edp"`` (the ranks holding the same experts, over which their
        gradients are averaged: the dp group while ``ep == 1``) or ``"replica"`` (the pp x tp
        ranks of one model replica, over which a global gradient norm is reduced)."""
        if name == "dp_cp":
            return self.dp_cp_mesh().get_group()
        if name == "ep":
            return self.ep_group
        if name == "edp":
            return self.edp_group if self.dims.ep > 1 else self.group("dp")
        if name == "replica":
            return self._replica_group()
        return self.mesh[name].get_group()

    def _replica_group(self) -> dist.ProcessGroup | None:
        """The pp x tp ranks that hold one model replica (this rank's dp and cp index): the
        "model-parallel" group of Megatron and of DeepSpeed's ``PipelineParallelGrid``, over which
        a global gradient norm is reduced. Made once (a collective: every rank calls it, in the
        same order, the first time)."""
        if "replica" not in self._groups:
            d = self.dims
            mesh = torch.tensor(self.trainer_ranks).reshape(mesh_shape(d))
            self._groups["replica"] = new_subgroup(
                [mesh[:, dp, cp].flatten().tolist() for dp in range(d.dp) for cp in range(d.cp)],
                self.device,
            )
        return self._groups["replica"]

    def axis_rank(self, axis: str) -> int:
        return self.mesh[axis].get_local_rank()

    def node_groups(self, axis: str = "dp") -> NodeGroups:
        """This rank's ``axis`` group split by node; built once (a collective: every rank calls
        it, in the same order, the first time)."""
        if axis not in self._node_groups:
            groups = mesh_groups(self.dims, axis, self.trainer_ranks)
            mine = next(ranks for ranks in groups if self.rank in ranks)
            parts = split_by_node(mine, self.node_of) or []
            intra, inter = node_enumeration(groups, self.node_of)
            self._node_groups[axis] = NodeGroups(
                nnodes=len(parts),
                local_size=len(parts[0]) if parts else 0,
                intra=dist.new_subgroups_by_enumeration(intra)[0] if intra else None,
                inter=dist.new_subgroups_by_enumeration(inter)[0] if inter else None,
            )
        return self._node_groups[axis]

    def dp_cp_mesh(self) -> dist.DeviceMesh:
        """The data- and context-parallel ranks as one mesh axis ``dp_cp`` (built once, by every
        rank: torchtitan's ``dp_shard_cp``), what gradients are reduced and FSDP shards over.
        Without context parallelism it is the ``dp`` axis itself."""
        if self.dims.cp == 1:
            return self.mesh["dp"]
        if self._dp_cp_mesh is None:
            self._dp_cp_mesh = self.mesh["dp", "cp"]._flatten("dp_cp")
        return self._dp_cp_mesh

    def side_group(self, purpose: str) -> dist.ProcessGroup | None:
        """A gloo group over the trainers of its own for ``purpose``, work beside the training
        step (background checkpoint writes, checkpoint replicas), so that its collectives never
        interleave with the step's (torchtitan does the same). One per purpose, made once (a
        collective: every trainer calls it at the same point); None without a process group."""
        if purpose not in self._groups and dist.is_initialized():
            self._groups[purpose] = dist.new_group(ranks=self.trainer_ranks, backend="gloo")
        return self._groups.get(purpose)

    def role_group(self, role: str) -> dist.ProcessGroup | None:
        """The ranks of ``role`` among themselves (e.g. the parameter servers), made by those
        ranks alone (``use_local_synchronization``) the first time; None for a role of one rank."""
        key = f"role:{role}"
        if key not in self._groups:
            ranks = list(self.roles.ranks[role])
            self._groups[key] = (
                dist.new_group(ranks, use_local_synchronization=True) if len(ranks) > 1 else None
            )
        return self._groups[key]

    @property
    def dp_rank(self) -> int:
        return self.axis_rank("dp")

    @property
    def data_parallel_rank(self) -> int:
        """Which share of the global batch this rank takes, of ``dims.data_parallel``: its
        ``dp_rank``, after the dp ranks of the replica groups before its own."""
        return self.replica_group_id * self.dims.dp + self.dp_rank

    @property
    def ep_rank(self) -> int:
        """Which share of the experts this rank holds (its place in its expert-parallel group)."""
        return self.dp_rank % self.dims.ep

    @property
    def edp_rank(self) -> int:
        return self.dp_rank // self.dims.ep

    @property
    def dp_cp_rank(self) -> int:
        """This rank's place in ``group("dp_cp")``."""
        return self.dp_rank * self.dims.cp + self.cp_rank

    @property
    def cp_rank(self) -> int:
        return self.axis_rank("cp")

    @property
    def tp_rank(self) -> int:
        return self.axis_rank("tp")

    @property
    def pp_rank(self) -> int:
        return self.axis_rank("pp")

    @property
    def is_logging_rank(self) -> bool:
        """The first trainer logs (rank 0 in a plain run)."""
        return self.rank == self.trainer_ranks[0]

    def describe(self) -> str:
        """This rank's place, for the start-up log."""
        return describe_rank(self)


def axis_backends(dims: ParallelDims, device: torch.device) -> list[str | None]:
    """Each mesh axis's backend (None: the job's own): a size-1 axis holds one rank per group,
    made without a communicator (``one_rank``), unless the job is one rank, whose every axis
    spans the job and reuses its group (as ``new_subgroup`` decides for other groups)."""
    one_rank = one_rank_backend(device) if dist.get_world_size() > 1 else None
    return [one_rank if size == 1 else None for size in mesh_shape(dims)]


def gather_node_ranks(node_rank: int, device: torch.device) -> list[int]:
    """Every rank's node rank (one all-gather at start-up)."""
    mine = torch.tensor([node_rank], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return [int(t.item()) for t in every]
