"""The sizes of the parallel axes (``ParallelDims``) and how many micro-batches a rank takes
per optimizer step as configured."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from omegaconf import OmegaConf

from plait.config import NodeRange, node_range


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

    ``replica_groups``: in a worker of a job whose data-parallel replicas run as independent
    torch jobs (a fault-tolerance plugin's replica groups, e.g. ``fault=torchft``), how many such
    groups there are; every other size here is then this group's own (``world_size``, ``dp``),
    and :attr:`data_parallel` counts the ranks that split the global batch over every group. A
    plan before launch describes all ranks as one layout (1).
    """

    dp: int
    tp: int
    pp: int
    world_size: int
    nnodes: int = 1
    cp: int = 1
    nodes: NodeRange = None  # type: ignore[assignment]  # nnodes:nnodes (__post_init__)
    grad_accum_steps: int = 1
    ep: int = 1  # expert parallelism, within dp: dp = edp x ep
    replica_groups: int = 1  # independent torch jobs the dp replicas run as (dp: one group's)

    def __post_init__(self) -> None:
        if self.nodes is None:
            object.__setattr__(self, "nodes", NodeRange(self.nnodes, self.nnodes))
        for axis in (
            "dp",
            "cp",
            "tp",
            "pp",
            "world_size",
            "nnodes",
            "grad_accum_steps",
            "ep",
            "replica_groups",
        ):
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
                f"{self.dp}, or give data parallelism more ranks (launcher.nproc_per_node)"
            )
        if self.dp % self.ep:
            raise ValueError(
                f"parallel.ep={self.ep} does not divide the data-parallel world dp={self.dp}: "
                f"choose parallel.ep in {[e for e in range(1, self.dp + 1) if self.dp % e == 0]}"
            )

    @classmethod
    def from_config(
        cls, cfg, world_size: int | None = None, nodes: NodeRange | None = None
    ) -> ParallelDims:
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
            raise ValueError(
                f"parallel.dp={dp} is out of range: set parallel.dp >= 1, or -1 for "
                "what parallel.cp, parallel.tp and parallel.pp leave of the world"
            )
        if dp == -1:
            if world_size % (cp * tp * pp):
                factors = (f"cp({cp}) * " if cp > 1 else "") + f"tp({tp}) * pp({pp})"
                settings = "parallel.cp / " if cp > 1 else ""
                raise ValueError(
                    f"world_size({world_size}) is not divisible by {factors}: change "
                    f"{settings}parallel.tp / parallel.pp or launcher.nproc_per_node"
                )
            dp = world_size // (cp * tp * pp)
        return cls(
            dp=dp,
            tp=tp,
            pp=pp,
            world_size=world_size,
            nnodes=nnodes,
            nodes=nodes,
            cp=cp,
            grad_accum_steps=configured_grad_accum_steps(cfg),
            ep=getattr(cfg.parallel, "ep", 1),
        )

    def one_replica_group(self, groups: int) -> ParallelDims:
        """This layout (of every rank) cut into ``groups`` replica groups of whole model
        replicas: one group's layout, ``dp`` and ``world_size`` divided by ``groups``."""
        if groups == 1:
            return self
        if self.dp % groups:
            raise ValueError(
                f"{groups} replica groups do not divide dp={self.dp}: each group holds whole "
                "model replicas (its tensor, pipeline and context-parallel ranks)"
            )
        return replace(
            self, dp=self.dp // groups, world_size=self.world_size // groups, replica_groups=groups
        )

    @property
    def data_parallel(self) -> int:
        """The ranks that split the global batch: ``dp`` of every replica group."""
        return self.dp * self.replica_groups

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
