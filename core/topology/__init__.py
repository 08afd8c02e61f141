"""The process layout: how many ranks go to data, context, tensor and pipeline parallelism, the
nodes they sit on, and the groups.

Ranks are laid out Megatron-style on a ``(pp, dp, cp, tp)`` device mesh: tensor-parallel peers
are adjacent ranks (on one node, where the fast links are), context-parallel peers (each holding a
part of every sequence) next, data-parallel peers after them, pipeline stages outermost (the order
of Megatron-core's ``tp-cp-ep-dp-pp`` and torchtitan's ``[pp, dp, cp, tp]``). Context-parallel
ranks read the same samples as their dp rank's other ranks but hold different tokens, so their
gradients are reduced together with the data-parallel ones: ``group("dp_cp")`` is the
``dp x cp`` group (Megatron's ``get_data_parallel_group(with_context_parallel=True)``,
torchtitan's ``dp_shard_cp``).

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

The package holds one module per job, and re-exports what plugins import from
``plait.topology``:

=================  ==============================================================================
``dims``           the sizes of the axes (``ParallelDims``), checked, and the configured
                   accumulation
``elastic``        the accumulation that keeps an elastic job's global batch at its present size
``device``         which device this process computes on
``launcher_env``   what the launcher tells a worker (its node, local rank, replica group), and
                   the restart's rendezvous store
``enumeration``    every group's global ranks without processes: mesh axes, experts, nodes
``roles``          which ranks play which role
``mesh``           ``Topology``: this rank's mesh and process groups, named ``group(name)``
``describe``       the layout as text
``aliases``        hook spec 1.x's Megatron-style group names, deprecated
=================  ==============================================================================
"""

from plait.topology.describe import describe_node_split, describe_nodes, describe_rank
from plait.topology.device import pick_device
from plait.topology.dims import ParallelDims, configured_grad_accum_steps
from plait.topology.elastic import elastic_grad_accum_steps
from plait.topology.enumeration import (
    MESH_AXES,
    expert_groups,
    mesh_groups,
    mesh_shape,
    node_enumeration,
    split_by_node,
)
from plait.topology.launcher_env import (
    LAUNCHER_ENV,
    REPLICA_GROUP_ENV,
    first_host,
    in_srun_task,
    launcher_node_env,
    replica_group_env,
    restart_safe_store,
    slurm_job_port,
)
from plait.topology.mesh import NodeGroups, Topology, gather_node_ranks
from plait.topology.roles import TRAINER, Roles

__all__ = [
    "LAUNCHER_ENV",
    "MESH_AXES",
    "REPLICA_GROUP_ENV",
    "TRAINER",
    "NodeGroups",
    "ParallelDims",
    "Roles",
    "Topology",
    "configured_grad_accum_steps",
    "describe_node_split",
    "describe_nodes",
    "describe_rank",
    "elastic_grad_accum_steps",
    "expert_groups",
    "first_host",
    "in_srun_task",
    "gather_node_ranks",
    "launcher_node_env",
    "mesh_groups",
    "mesh_shape",
    "node_enumeration",
    "pick_device",
    "replica_group_env",
    "restart_safe_store",
    "slurm_job_port",
    "split_by_node",
]
