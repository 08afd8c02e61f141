"""The process layout: how many ranks go to data, context, tensor and pipeline parallelism, the
nodes they sit on, and the groups.

Ranks are laid out Megatron-style on a ``(pp, dp, cp, tp)`` device mesh: tensor-parallel peers
are adjacent ranks (on one node, where the fast links are), context-parallel peers (each holding a
part of every sequence) next, data-parallel peers after them, pipeline stages outermost (the order
of Megatron-core's ``tp-cp-ep-dp-pp`` and torchtitan's ``[pp, dp, cp, tp]``). Context-parallel
ranks read the same samples as their dp rank's other ranks but hold different tokens, so their
gradients are reduced together with the data-parallel ones: ``get_data_parallel_group(
with_context_parallel=True)`` is the ``dp x cp`` group (Megatron's name; torchtitan's
``dp_shard_cp``).

Which node each rank runs on comes from the launcher (torch elastic / ``torchrun`` set
``GROUP_RANK``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``; plait's launcher derives them from
``srun``'s variables) and is gathered once, so a group's split into nodes is known, not guessed
from rank numbers::

    2 nodes x 4 processes, tp=2, dp=4:   dp group [0, 2, 4, 6] = node 0: [0, 2] | node 1: [4, 6]
    intra-node groups [0, 2], [4, 6]     inter-node groups [0, 4], [2, 6]   (strided by tp)

Expert parallelism is carved out of the data-parallel ranks (Megatron's and torchtitan's
layout, and DeepSpeed's ``_get_expert_parallel_ranks``): each dp group of ``dp`` ranks splits into
``dp / ep`` expert-parallel groups of ``ep`` consecutive dp ranks, which hold different experts
and exchange tokens, and ``ep`` expert-data-parallel groups of the ranks that hold the same
experts (every ``ep``-th dp rank), over which those experts' gradients are averaged::

    dp=4, ep=2:   dp group [0, 1, 2, 3]   ep groups [0, 1], [2, 3]   edp groups [0, 2], [1, 3]

A strategy may carve the ranks into roles (``plait_assign_roles``), e.g. parameter servers and
trainers. The mesh then holds the trainers only; every collective of the core and the shared
plugins runs over the trainer group (``trainer_group``, or ``step_group`` for per-step figures),
the logging rank is the first trainer, and a rank of another role runs its plugin's loop
(``plait_run_role``) instead of the train loop. With one role (the default) both groups are the
default group and nothing else changes.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from plait.config import NodeRange, node_range
from plait.host_memory import fix_mmap_threshold

MESH_AXES = ("pp", "dp", "cp", "tp")
TRAINER = "trainer"


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of each parallel axis; their product is the world size.

    ``dp=-1`` in the config means "whatever is left": ``world_size // (cp * tp * pp)``.

    ``nnodes``: the nodes the ranks run on (a plan counts MAX of an elastic range; a running
    job, the nodes its group formed with). ``nodes``: ``launcher.nnodes`` as ``(MIN, MAX)``,
    parsed once here (``plait.config.node_range``), so no plugin parses the setting again;
    default ``nnodes:nnodes``. ``grad_accum_steps``: micro-batches per rank per optimizer step,
    ``train.grad_accum_steps`` at MAX nodes and, in a running elastic job, what keeps the global
    batch at its size (:func:`elastic_grad_accum_steps`); read it here, not from the config.
    """

    dp: int
    tp: int
    pp: int
    world_size: int
    nnodes: int = 1
    cp: int = 1
    nodes: NodeRange | None = None
    grad_accum_steps: int = 1
    ep: int = 1  # expert parallelism, within dp: dp = edp x ep

    def __post_init__(self) -> None:
        if self.nodes is None:
            object.__setattr__(self, "nodes", NodeRange(self.nnodes, self.nnodes))
        for axis in ("dp", "cp", "tp", "pp", "world_size", "nnodes", "grad_accum_steps", "ep"):
            if getattr(self, axis) < 1:
                raise ValueError(f"{axis}={getattr(self, axis)} must be at least 1")
        if self.dp * self.cp * self.tp * self.pp != self.world_size:
            cp = f" * cp({self.cp})" if self.cp > 1 else ""
            raise ValueError(
                f"dp({self.dp}){cp} * tp({self.tp}) * pp({self.pp}) != world_size("
                f"{self.world_size}): set parallel.dp=-1 to fill the remaining ranks with data "
                "parallelism, or change launcher.nproc_per_node / launcher.nnodes"
            )
        if self.ep > self.dp:
            raise ValueError(
                f"parallel.ep={self.ep} is larger than the data-parallel world dp={self.dp}: "
                "experts are spread over data-parallel ranks; set parallel.ep to a divisor of "
                f"{self.dp}, or give data parallelism more ranks (launcher.nproc_per_node)")
        if self.dp % self.ep:
            raise ValueError(
                f"parallel.ep={self.ep} does not divide the data-parallel world dp={self.dp}: "
                f"choose parallel.ep in {[e for e in range(1, self.dp + 1) if self.dp % e == 0]}")

    @classmethod
    def from_config(cls, cfg, world_size: int | None = None,
                    nodes: NodeRange | None = None) -> ParallelDims:
        """The layout ``cfg`` asks for at ``world_size`` (default: the launcher's, else
        ``launcher.nnodes x launcher.nproc_per_node``); ``nodes``: ``launcher.nnodes`` already
        parsed (else parsed here)."""
        launcher = cfg.launcher
        nodes = nodes or node_range(launcher.nnodes)
        nnodes = nodes.max
        if world_size is None:
            world_size = int(os.environ.get("WORLD_SIZE", nnodes * launcher.nproc_per_node))
        tp, pp = cfg.parallel.tp, cfg.parallel.pp
        cp = getattr(cfg.parallel, "cp", 1)  # a config made for a topology alone may omit it
        dp = cfg.parallel.dp
        if dp < -1 or dp == 0:
            raise ValueError(f"parallel.dp={dp} is out of range: set parallel.dp >= 1, or -1 for "
                             "what parallel.cp, parallel.tp and parallel.pp leave of the world")
        if dp == -1:
            if world_size % (cp * tp * pp):
                factors = (f"cp({cp}) * " if cp > 1 else "") + f"tp({tp}) * pp({pp})"
                settings = "parallel.cp / " if cp > 1 else ""
                raise ValueError(
                    f"world_size({world_size}) is not divisible by {factors}: change "
                    f"{settings}parallel.tp / parallel.pp or launcher.nproc_per_node"
                )
            dp = world_size // (cp * tp * pp)
        return cls(dp=dp, tp=tp, pp=pp, world_size=world_size, nnodes=nnodes, nodes=nodes, cp=cp,
                   grad_accum_steps=configured_grad_accum_steps(cfg),
                   ep=getattr(cfg.parallel, "ep", 1))

    @property
    def edp(self) -> int:
        """Expert-data-parallel size: the ranks holding the same experts."""
        return self.dp // self.ep

    @property
    def elastic(self) -> bool:
        """``launcher.nnodes=MIN:MAX`` with MIN < MAX: the job goes on at any size between."""
        return self.nodes.elastic

    @property
    def enabled_axes(self) -> frozenset[str]:
        return frozenset(a for a in ("dp", "cp", "tp", "pp", "ep") if getattr(self, a) > 1)

    @property
    def dp_cp(self) -> int:
        """The ranks one parameter's gradients are reduced over: data- and context-parallel."""
        return self.dp * self.cp


def configured_grad_accum_steps(cfg) -> int:
    """``train.grad_accum_steps``; 1 for a config made for a topology alone (collectives, no
    training loop: a benchmark's, a test's), which may leave ``train`` out."""
    return OmegaConf.select(cfg, "train.grad_accum_steps", default=1)


def elastic_grad_accum_steps(cfg, dims: ParallelDims, local_world_size: int) -> int:
    """``train.grad_accum_steps`` at the world size of ``dims`` (a job's layout at some size of
    ``dims.nodes``); :meth:`Topology.initialize` stores it as ``dims.grad_accum_steps``.

    In an elastic job (``launcher.nnodes=MIN:MAX``) ``train.batch_size`` and
    ``train.grad_accum_steps`` are given for MAX nodes. At fewer nodes the per-rank micro-batch
    stays as it is and the accumulation grows by ``dp_at_MAX / dp``, so that every step still
    takes the global batch::

        train.batch_size = micro_batch_size x grad_accum_steps x dp      (at every size)
        grad_accum_steps(dp) = train.grad_accum_steps x dp_at_MAX / dp

    A job of fixed size keeps ``train.grad_accum_steps``. ``ValueError`` when ``dp`` does not
    divide ``train.grad_accum_steps x dp_at_MAX`` (refused before launch for every size in the
    range).
    """
    nodes = dims.nodes
    if not nodes.elastic:
        return configured_grad_accum_steps(cfg)
    full = ParallelDims.from_config(cfg, world_size=nodes.max * local_world_size, nodes=nodes)
    micro_batches = cfg.train.grad_accum_steps * full.dp  # per step, over all dp ranks
    if micro_batches % dims.dp:
        nodes_now = dims.world_size // local_world_size
        raise ValueError(
            f"launcher.nnodes={cfg.launcher.nnodes}: at {nodes_now} node(s) dp is {dims.dp}, "
            f"which cannot share the {micro_batches} micro-batches of a step (train."
            f"grad_accum_steps={cfg.train.grad_accum_steps} x dp {full.dp} at {nodes.max} "
            f"nodes), so train.batch_size={cfg.train.batch_size} cannot be kept: set "
            f"train.grad_accum_steps to a multiple of {dims.dp // math.gcd(full.dp, dims.dp)} "
            "(and train.batch_size to match), or narrow launcher.nnodes")
    return micro_batches // dims.dp


def pick_device(requested: str) -> torch.device:
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    if requested == "cpu":
        fix_mmap_threshold()  # tensors on the host go back to the kernel when freed
    return torch.device(requested)


LAUNCHER_ENV = ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")


def launcher_node_env(environ: dict[str, str]) -> tuple[int, int, int]:
    """``(node_rank, local_rank, local_world_size)`` as the launcher set them.

    torch elastic (``plait train``, ``torchrun``) sets all three; under ``srun`` plait's launcher
    derives them from ``SLURM_NODEID``, ``SLURM_LOCALID`` and ``SLURM_TASKS_PER_NODE``.
    """
    missing = [name for name in LAUNCHER_ENV if name not in environ]
    if missing:
        raise ValueError(
            f"{', '.join(missing)} not set: plait learns the nodes from the launcher; start the "
            "workers with `plait train`, `torchrun` or `srun ... plait train`")
    return (int(environ["GROUP_RANK"]), int(environ["LOCAL_RANK"]),
            int(environ["LOCAL_WORLD_SIZE"]))


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


def expert_groups(dims: ParallelDims, ranks: list[int] | None = None
                  ) -> tuple[list[list[int]], list[list[int]]]:
    """The expert-parallel and expert-data-parallel groups (global ranks): each dp group cut into
    runs of ``ep`` consecutive dp ranks, and the ranks at the same place in each run."""
    ep_groups, edp_groups = [], []
    for group in mesh_groups(dims, "dp", ranks):
        runs = [group[i:i + dims.ep] for i in range(0, dims.dp, dims.ep)]
        ep_groups += runs
        edp_groups += [list(peers) for peers in zip(*runs)]
    return ep_groups, edp_groups


def mesh_shape(dims: ParallelDims) -> tuple[int, int, int, int]:
    return (dims.pp, dims.dp, dims.cp, dims.tp)


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
        lines.append("  roles: " + ", ".join(f"{role} {list(ranks)}"
                                              for role, ranks in roles.ranks.items()))
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
            lines.append("  no intra-/inter-node groups: each dp group lies on one node or has "
                         "one rank per node")
    return lines


@dataclass(frozen=True)
class Roles:
    """Which global ranks play which role. ``trainer`` ranks run the train loop over the
    ``(pp, dp, tp)`` mesh; every other role runs the loop its plugin provides (``plait_run_role``).

    ``lockstep``: the trainers take their steps together, so per-step collectives among them
    (the logged figures' min/max, evaluation, checkpoints) are safe; False for trainers that step
    at their own pace (asynchronous parameter-server workers), whose per-step figures are then
    their own and whose checkpoints the first trainer writes alone.

    ``expendable``: ranks whose death the job survives (asynchronous workers other than the
    first trainer, which logs and checkpoints): plait's launcher counts such a death as the rank
    leaving, where it would otherwise end every rank.
    """

    ranks: dict[str, tuple[int, ...]]
    lockstep: bool = True
    expendable: tuple[int, ...] = ()

    @classmethod
    def resolve(cls, assigned: Roles | None, world_size: int) -> Roles:
        """The strategy's roles, checked; everyone a trainer when the strategy assigns none."""
        if assigned is None:
            return cls({TRAINER: tuple(range(world_size))})
        given = sorted(r for ranks in assigned.ranks.values() for r in ranks)
        if given != list(range(world_size)):
            raise ValueError(f"roles {dict(assigned.ranks)} must give each of the {world_size} "
                             "ranks exactly one role")
        if not assigned.ranks.get(TRAINER):
            raise ValueError(f"roles {dict(assigned.ranks)} leave no {TRAINER} rank")
        return assigned

    @property
    def trainers(self) -> list[int]:
        return list(self.ranks[TRAINER])

    @property
    def single(self) -> bool:
        """Every rank is a trainer: the layout of a plain run."""
        return len(self.ranks) == 1

    def role_of(self, rank: int) -> str:
        return next(role for role, ranks in self.ranks.items() if rank in ranks)


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


def restart_safe_store(timeout: timedelta) -> dist.Store | None:
    """The rendezvous store with this restart's own key space, under torch elastic's shared store.

    torch elastic (``torchrun``, plait's launcher) hands workers the agent's rendezvous TCPStore
    (``TORCHELASTIC_USE_AGENT_STORE=True``); it outlives a restart, so a restarted worker can read
    the previous attempt's process-group keys (a dead peer's gloo address) and fail in
    ``connectFullMesh`` (pytorch/pytorch#135712). Prefixing every key with the restart count
    gives each attempt a fresh key space. None: not under torch elastic's shared store.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timeout)
    return dist.PrefixStore(f"plait/attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}", store)


@dataclass
class Topology:
    """This rank's place in the mesh, the node it runs on, and the process groups of each axis."""

    dims: ParallelDims
    device: torch.device
    mesh: dist.DeviceMesh
    rank: int
    local_rank: int
    node_rank: int
    local_world_size: int
    node_of: list[int]  # the node rank of every global rank, as the launcher assigned it
    roles: Roles | None = None  # None: every rank is a trainer
    # The core's and shared plugins' collectives run over these (None: the default group, as in
    # a plain run). trainer_group: start-up and checkpoints; step_group: per-step figures.
    trainer_group: dist.ProcessGroup | None = None
    step_group: dist.ProcessGroup | None = None
    # parallel.ep > 1: this rank's expert-parallel and expert-data-parallel groups
    ep_group: dist.ProcessGroup | None = None
    edp_group: dist.ProcessGroup | None = None
    _node_groups: dict[str, NodeGroups] = field(default_factory=dict, repr=False)
    _dp_cp_mesh: dist.DeviceMesh | None = field(default=None, repr=False)
    _groups: dict[str, dist.ProcessGroup | None] = field(default_factory=dict, repr=False)

    @classmethod
    def initialize(cls, cfg, assign_roles: Callable[[int], Roles | None] | None = None) -> Topology:
        """Join the process group started by the launcher, learn the nodes, give each rank its
        role (``assign_roles(world_size)``, the strategy's answer), build the trainers' mesh."""
        node_rank, local_rank, local_world_size = launcher_node_env(dict(os.environ))
        device = pick_device(cfg.device)
        if not dist.is_initialized():
            backend = "nccl" if device.type == "cuda" else "gloo"
            timeout = timedelta(seconds=cfg.launcher.timeout_s)
            store = restart_safe_store(timeout)
            if store is None:
                dist.init_process_group(backend, timeout=timeout)
            else:
                dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]),
                                        world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
        world_size = dist.get_world_size()
        roles = Roles.resolve(assign_roles(world_size) if assign_roles else None, world_size)
        trainers = roles.trainers
        node_of = gather_node_ranks(node_rank, device)
        dims = ParallelDims.from_config(cfg, world_size=len(trainers))
        # an elastic job keeps train.batch_size at this size by accumulating more or less
        dims = replace(dims, nnodes=len({node_of[r] for r in trainers}),
                       grad_accum_steps=elastic_grad_accum_steps(cfg, dims, local_world_size))
        groups = {}
        if roles.single:  # today's layout, untouched: the default group is the trainer group
            mesh = dist.init_device_mesh(device.type, mesh_shape(dims), mesh_dim_names=MESH_AXES)
        else:  # every rank takes part in creating each group, members or not
            mesh = dist.DeviceMesh(device.type, torch.tensor(trainers).reshape(mesh_shape(dims)),
                                   mesh_dim_names=MESH_AXES)
            groups["trainer_group"] = groups["step_group"] = dist.new_group(trainers)
        if not roles.lockstep:
            groups["step_group"] = dist.new_subgroups_by_enumeration([[r] for r in trainers])[0]
        if dims.ep > 1:  # every rank takes part in creating each group
            ep_ranks, edp_ranks = expert_groups(dims, trainers)
            groups["ep_group"] = dist.new_subgroups_by_enumeration(ep_ranks)[0]
            groups["edp_group"] = dist.new_subgroups_by_enumeration(edp_ranks)[0]
        return cls(dims=dims, device=device, mesh=mesh, rank=dist.get_rank(),
                   local_rank=local_rank, node_rank=node_rank,
                   local_world_size=local_world_size, node_of=node_of, roles=roles, **groups)

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

    def group(self, axis: str) -> dist.ProcessGroup:
        return self.mesh[axis].get_group()

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
                nnodes=len(parts), local_size=len(parts[0]) if parts else 0,
                intra=dist.new_subgroups_by_enumeration(intra)[0] if intra else None,
                inter=dist.new_subgroups_by_enumeration(inter)[0] if inter else None)
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

    def replica_group(self) -> dist.ProcessGroup:
        """The pp x tp ranks that hold one model replica (this rank's dp and cp index): the
        "model-parallel" group of Megatron and of DeepSpeed's ``PipelineParallelGrid``, over which
        a global gradient norm is reduced. Made once (a collective: every rank calls it, in the
        same order, the first time)."""
        if "replica" not in self._groups:
            d = self.dims
            mesh = torch.tensor(self.trainer_ranks).reshape(mesh_shape(d))
            self._groups["replica"] = dist.new_subgroups_by_enumeration(
                [mesh[:, dp, cp].flatten().tolist()
                 for dp in range(d.dp) for cp in range(d.cp)])[0]
        return self._groups["replica"]

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
            self._groups[key] = (dist.new_group(ranks, use_local_synchronization=True)
                                 if len(ranks) > 1 else None)
        return self._groups[key]

    # Megatron-core names, for code ported from there and for DeepSpeed's ``mpu`` interface.
    def get_data_parallel_group(self, with_context_parallel: bool = False) -> dist.ProcessGroup:
        """The ranks that read different samples (``dp``); ``with_context_parallel``: and the
        context-parallel ranks that hold other tokens of them, whose gradients are averaged
        together (Megatron's ``get_data_parallel_group(with_context_parallel=True)``)."""
        if with_context_parallel:
            return self.dp_cp_mesh().get_group()
        return self.group("dp")

    def get_context_parallel_group(self) -> dist.ProcessGroup:
        return self.group("cp")

    def get_tensor_model_parallel_group(self) -> dist.ProcessGroup:
        return self.group("tp")

    def get_pipeline_model_parallel_group(self) -> dist.ProcessGroup:
        return self.group("pp")

    def get_expert_parallel_group(self) -> dist.ProcessGroup | None:
        return self.ep_group

    def get_expert_data_parallel_group(self) -> dist.ProcessGroup:
        """Where expert parameters are averaged: the dp group while ``ep == 1``."""
        return self.edp_group if self.dims.ep > 1 else self.group("dp")

    @property
    def dp_rank(self) -> int:
        return self.axis_rank("dp")

    @property
    def ep_rank(self) -> int:
        """Which share of the experts this rank holds (its place in its expert-parallel group)."""
        return self.dp_rank % self.dims.ep

    @property
    def edp_rank(self) -> int:
        return self.dp_rank // self.dims.ep

    @property
    def dp_cp_rank(self) -> int:
        """This rank's place in ``get_data_parallel_group(with_context_parallel=True)``."""
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
        d = self.dims
        if self.role != TRAINER:
            return (f"{self.role} rank {self.rank}/{len(self.node_of)} (node {self.node_rank}, "
                    f"local {self.local_rank}/{self.local_world_size}) on {self.device}")
        return (
            f"rank {self.rank}/{d.world_size} (node {self.node_rank}, local {self.local_rank}/"
            f"{self.local_world_size}) pp={self.pp_rank}/{d.pp} dp={self.dp_rank}/{d.dp} "
            + (f"cp={self.cp_rank}/{d.cp} " if d.cp > 1 else "")
            + f"tp={self.tp_rank}/{d.tp}" + (f" ep={self.ep_rank}/{d.ep}" if d.ep > 1 else "")
            + f" on {self.device}"
        )


def gather_node_ranks(node_rank: int, device: torch.device) -> list[int]:
    """Every rank's node rank (one all-gather at start-up)."""
    mine = torch.tensor([node_rank], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return [int(t.item()) for t in every]
