"""The process layout: how many ranks go to data, tensor and pipeline parallelism, and the groups.

Ranks are laid out Megatron-style on a ``(pp, dp, tp)`` device mesh: tensor-parallel peers are
adjacent ranks (on one node, where the fast links are), data-parallel peers next, pipeline stages
outermost.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

MESH_AXES = ("pp", "dp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of each parallel axis; their product is the world size.

    ``dp=-1`` in the config means "whatever is left": ``world_size // (tp * pp)``.
    """

    dp: int
    tp: int
    pp: int
    world_size: int
    nnodes: int = 1

    def __post_init__(self) -> None:
        for axis in ("dp", "tp", "pp", "world_size", "nnodes"):
            if getattr(self, axis) < 1:
                raise ValueError(f"{axis}={getattr(self, axis)} must be at least 1")
        if self.dp * self.tp * self.pp != self.world_size:
            raise ValueError(
                f"dp({self.dp}) * tp({self.tp}) * pp({self.pp}) != world_size({self.world_size}): "
                "set parallel.dp=-1 to fill the remaining ranks with data parallelism, or change "
                "launcher.nproc_per_node / launcher.nnodes"
            )

    @classmethod
    def from_config(cls, cfg, world_size: int | None = None) -> ParallelDims:
        launcher = cfg.launcher
        if world_size is None:
            world_size = int(os.environ.get("WORLD_SIZE", launcher.nnodes * launcher.nproc_per_node))
        tp, pp = cfg.parallel.tp, cfg.parallel.pp
        dp = cfg.parallel.dp
        if dp < -1 or dp == 0:
            raise ValueError(f"parallel.dp={dp} is out of range: set parallel.dp >= 1, or -1 for "
                             "what parallel.tp and parallel.pp leave of the world")
        if dp == -1:
            if world_size % (tp * pp):
                raise ValueError(
                    f"world_size({world_size}) is not divisible by tp({tp}) * pp({pp}): change "
                    "parallel.tp / parallel.pp or launcher.nproc_per_node"
                )
            dp = world_size // (tp * pp)
        return cls(dp=dp, tp=tp, pp=pp, world_size=world_size, nnodes=launcher.nnodes)

    @property
    def enabled_axes(self) -> frozenset[str]:
        return frozenset(a for a in ("dp", "tp", "pp") if getattr(self, a) > 1)


def pick_device(requested: str) -> torch.device:
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device(requested)


@dataclass
class Topology:
    """This rank's place in the mesh and the process groups of each axis."""

    dims: ParallelDims
    device: torch.device
    mesh: dist.DeviceMesh
    rank: int
    local_rank: int
    node_rank: int
    local_world_size: int

    @classmethod
    def initialize(cls, cfg) -> Topology:
        """Join the process group started by the launcher and build the mesh."""
        device = pick_device(cfg.device)
        if not dist.is_initialized():
            backend = "nccl" if device.type == "cuda" else "gloo"
            dist.init_process_group(backend, timeout=timedelta(seconds=cfg.launcher.timeout_s))
        dims = ParallelDims.from_config(cfg, world_size=dist.get_world_size())
        mesh = dist.init_device_mesh(
            device.type, (dims.pp, dims.dp, dims.tp), mesh_dim_names=MESH_AXES
        )
        return cls(
            dims=dims,
            device=device,
            mesh=mesh,
            rank=dist.get_rank(),
            local_rank=int(os.environ.get("LOCAL_RANK", 0)),
            node_rank=int(os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK", 0))),
            local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size())),
        )

    def group(self, axis: str) -> dist.ProcessGroup:
        return self.mesh[axis].get_group()

    def axis_rank(self, axis: str) -> int:
        return self.mesh[axis].get_local_rank()

    # Megatron-core names, for code ported from there and for DeepSpeed's ``mpu`` interface.
    def get_data_parallel_group(self) -> dist.ProcessGroup:
        return self.group("dp")

    def get_tensor_model_parallel_group(self) -> dist.ProcessGroup:
        return self.group("tp")

    def get_pipeline_model_parallel_group(self) -> dist.ProcessGroup:
        return self.group("pp")

    @property
    def dp_rank(self) -> int:
        return self.axis_rank("dp")

    @property
    def tp_rank(self) -> int:
        return self.axis_rank("tp")

    @property
    def pp_rank(self) -> int:
        return self.axis_rank("pp")

    @property
    def is_logging_rank(self) -> bool:
        return self.rank == 0

    def describe(self) -> str:
        d = self.dims
        return (
            f"rank {self.rank}/{d.world_size} (node {self.node_rank}, local {self.local_rank}) "
            f"pp={self.pp_rank}/{d.pp} dp={self.dp_rank}/{d.dp} tp={self.tp_rank}/{d.tp} "
            f"on {self.device}"
        )
