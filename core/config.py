"""The config schema: dataclasses in Hydra's ConfigStore, so a typo or a wrong type is an error.

The core owns the sections it reads itself (``train``, ``run``, ``parallel``, ``launcher`` and the
top-level scalars) and one base class per config group with the ``name`` that selects a plugin.
A plugin with settings of its own subclasses the base and stores the subclass from its
``plait_register_configs`` hook as ``<group>/base_<name>``; its YAML option lists that schema
first in its defaults list (Hydra's structured-config pattern).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

GROUPS = ("strategy", "parallel", "comm", "data", "model", "optimizer", "fault", "tracker",
          "launcher")
PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass
class TrainConfig:
    steps: int = 50
    batch_size: int = 16  # global batch: sequences per optimizer step, over all dp ranks
    grad_accum_steps: int = 1
    seq_len: int = 64
    grad_clip: float = 1.0  # max global grad norm; 0 turns clipping off
    log_every: int = 1
    eval_every: int = 0  # 0: no evaluation
    eval_batches: int = 4
    peak_flops: float = 1e12  # dense peak FLOP/s of one device, for the MFU estimate
    compile: bool = False  # torch.compile the model (engines that support it)


@dataclass
class RunConfig:
    root: str = "runs"
    name: str = "${plait_run_name:}"
    dir: str = "${run.root}/${run.name}"


@dataclass
class ParallelConfig:
    dp: int = -1  # -1: world_size // (tp * pp)
    tp: int = 1
    pp: int = 1
    sequence_parallel: bool = False
    microbatches: int = 1  # pipeline micro-batches per optimizer step
    schedule: str = "1f1b"
    virtual_stages: int = 1
    balance: Any = "layers"
    tensor: str = "megatron"  # the plugin that splits layers when tp > 1
    # None: the built-in plan for model._target_; a name ("gpt", "llama"); or
    # {module-name pattern: colwise|colwise_qkv|rowwise|vocab|norm|sequence_scatter|replicate}
    tp_plan: Any = None
    pipeline: str = "torch"  # the plugin that cuts stages when pp > 1


@dataclass
class LauncherConfig:
    name: str = "local"
    nproc_per_node: int = 2
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: pick a free port (single node)
    local_addr: Optional[str] = None  # this node's address as the others reach it (multi-node)
    max_restarts: int = 0
    timeout_s: int = 300


@dataclass
class StrategyConfig:
    name: str = MISSING


@dataclass
class CommConfig:
    name: str = MISSING


@dataclass
class DataConfig:
    name: str = MISSING
    path: Optional[str] = None
    cache_dir: str = "${oc.env:PLAIT_CACHE_DIR,'~/.cache/plait'}"
    val_fraction: float = 0.01
    sharding: str = "contiguous"
    shuffle: bool = True


@dataclass
class ModelConfig:
    _target_: str = MISSING


@dataclass
class OptimizerConfig:
    name: str = MISSING
    lr: float = 1e-3


@dataclass
class FaultConfig:
    name: str = MISSING


@dataclass
class TrackerConfig:
    name: str = MISSING


@dataclass
class PlaitConfig:
    strategy: StrategyConfig = MISSING
    parallel: ParallelConfig = MISSING
    comm: CommConfig = MISSING
    data: DataConfig = MISSING
    model: ModelConfig = MISSING
    optimizer: OptimizerConfig = MISSING
    fault: FaultConfig = MISSING
    tracker: TrackerConfig = MISSING
    launcher: LauncherConfig = MISSING
    train: TrainConfig = field(default_factory=TrainConfig)
    run: RunConfig = field(default_factory=RunConfig)
    seed: int = 1337
    precision: str = "fp32"
    device: str = "auto"  # auto: cuda when available, else cpu
    resume: Optional[str] = None  # "latest" or a checkpoint / run directory
    plugins: list[str] = field(default_factory=list)  # dotted paths of in-house plugins


def store_core_schemas(cs: ConfigStore) -> None:
    cs.store(name="base_config", node=PlaitConfig)
    for group, node in [("strategy", StrategyConfig), ("parallel", ParallelConfig),
                        ("comm", CommConfig), ("data", DataConfig), ("model", ModelConfig),
                        ("optimizer", OptimizerConfig), ("fault", FaultConfig),
                        ("tracker", TrackerConfig), ("launcher", LauncherConfig)]:
        cs.store(group=group, name=f"base_{group}", node=node)
