"""The config schema: dataclasses in Hydra's ConfigStore, so a typo or a wrong type is an error.

The core owns the sections it reads itself (``train``, ``run``, the ``parallel`` layout, the
launcher's process counts and the top-level scalars) and one base class per config group with the
``name`` that selects a plugin; it reads no plugin's settings (``tests/test_layout.py`` checks).
A plugin with settings of its own subclasses the base and stores the subclass from its
``plait_register_configs`` hook as ``<group>/base_<name>``; its YAML option lists that schema
first in its defaults list (Hydra's structured-config pattern).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping, NamedTuple, Optional, get_type_hints

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, ListConfig

PRECISIONS = ("fp32", "bf16", "fp16")
BYTES_PER_VALUE = {"fp32": 4, "bf16": 2, "fp16": 2}  # of a tensor element in each precision


def runs_on_cpu(cfg) -> bool:
    """Whether the run's ``device`` (cpu, cuda, auto) puts it on the host: ``auto`` without a
    CUDA device does (as :func:`plait.topology.pick_device` picks it)."""
    import torch

    return cfg.device == "cpu" or (cfg.device == "auto" and not torch.cuda.is_available())


# plait's cache directory on this node: $PLAIT_CACHE_DIR, else ~/.cache/plait. CACHE_DIR is it as
# a config value (the data plugins' ``cache_dir`` default, resolved with the config); cache_dir()
# as a path, for a plugin that caches outside any setting (the eval harness's task index).
CACHE_ENV, DEFAULT_CACHE_DIR = "PLAIT_CACHE_DIR", "~/.cache/plait"
CACHE_DIR = f"${{oc.env:{CACHE_ENV},'{DEFAULT_CACHE_DIR}'}}"


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE_DIR).expanduser()


ACTIVATION_CHECKPOINTING = ("none", "full", "selective")


@dataclass
class TrainConfig:
    steps: int = 50
    batch_size: int = 16  # global batch: sequences per optimizer step, over all dp ranks
    grad_accum_steps: int = 1
    seq_len: int = 64
    grad_clip: float = 1.0  # max global grad norm; 0 turns clipping off
    # console, metrics file and tracker every N steps and the last; the per-rank figures
    # (a gather) and phase timing on those steps only (torchtitan's log_freq, DeepSpeed's
    # steps_per_print: 10)
    log_every: int = 10
    eval_every: int = 0  # 0: no evaluation
    eval_batches: int = 4
    # End this job after this step (checkpointed, evaluated) while the schedule still spans
    # train.steps: one round of population-based training. None: run to train.steps.
    stop_at: Optional[int] = None
    # Dense peak FLOP/s of one device, for MFU. None: the device's own figure where it is a
    # known GPU; no MFU is reported on other devices unless this is set.
    peak_flops: Optional[float] = None
    # none | full (recompute each transformer block) | selective (recompute the attention core);
    # carried out by the activation_checkpointing plugin, which this setting selects.
    activation_checkpointing: str = "none"


def job_last_step(train: Any) -> int:
    """The step this job ends after: ``train.stop_at`` where set (one population-based training
    round; the schedule still spans ``train.steps``), else ``train.steps``. Every role that
    counts steps (trainers, parameter servers) ends there."""
    return min(train.steps, train.stop_at or train.steps)


@dataclass
class RunConfig:
    root: str = "runs"
    name: str = "${plait_run_name:}"
    dir: str = "${run.root}/${run.name}"
    # The sweep (`plait train -m`) this run is one job of; plait sets it for each job.
    sweep: Optional[str] = None


@dataclass
class ParallelConfig:
    """The process layout, which the core owns; how layers are split is each plugin's schema."""

    dp: int = -1  # -1: world_size // (cp * tp * pp)
    tp: int = 1
    pp: int = 1
    ep: int = 1  # expert parallelism: experts spread over ep of the dp ranks (ep divides dp)
    cp: int = 1  # context parallelism: each sequence split over cp ranks


@dataclass
class LauncherConfig:
    name: str = MISSING
    nproc_per_node: int = 2
    # N nodes, or MIN:MAX (torchrun's syntax): elastic, the job goes on at any node count in the
    # range; train.batch_size and train.grad_accum_steps are then those of MAX nodes.
    nnodes: Any = 1
    timeout_s: int = 300  # process-group timeout: a collective waiting longer fails the job
    # the workers' host memory allocator on CPU runs: auto (tcmalloc, else jemalloc, else glibc)
    # | tcmalloc | jemalloc | glibc | glibc_mmap (plait.host_memory)
    allocator: str = "auto"
    # the share of the job's memory cap (its memory cgroup's, else the machine's) above which CPU
    # workers on tcmalloc hand freed memory back at every free; 1: never (plait.memory_cap)
    decommit_above: float = 0.8


class NodeRange(NamedTuple):
    min: int
    max: int

    @property
    def elastic(self) -> bool:
        return self.min < self.max


def node_range(nnodes: Any) -> NodeRange:
    """``launcher.nnodes`` as ``(MIN, MAX)``: ``N`` is ``N:N``; ``MIN:MAX`` is read by torchrun's
    own parser (``--nnodes``). ``ValueError`` naming the setting for anything else."""
    from torch.distributed.run import parse_min_max_nnodes

    try:
        low, high = parse_min_max_nnodes(str(nnodes))
    except (RuntimeError, ValueError):
        raise ValueError(
            f"launcher.nnodes={nnodes} is not a node count: give N, or MIN:MAX "
            "for an elastic job (e.g. launcher.nnodes=1:2)"
        ) from None
    if low < 1 or high < low:
        raise ValueError(
            f"launcher.nnodes={nnodes} is out of range: set launcher.nnodes >= 1, "
            "or MIN:MAX with 1 <= MIN <= MAX"
        )
    return NodeRange(low, high)


# One base per config group: the ``name`` that selects a plugin. A plugin subclasses its base
# with the settings it reads.


@dataclass
class StrategyConfig:
    name: str = MISSING


@dataclass
class TensorParallelConfig:
    name: str = MISSING


@dataclass
class ExpertParallelConfig:
    name: str = MISSING


@dataclass
class ContextParallelConfig:
    name: str = MISSING


@dataclass
class PipelineConfig:
    name: str = MISSING


@dataclass
class CommConfig:
    name: str = MISSING


@dataclass
class DataConfig:
    name: str = MISSING
    sharding: str = "contiguous"  # selects the plugin that gives each dp rank its samples


@dataclass
class ModelConfig:
    _target_: str = MISSING


@dataclass
class OptimizerConfig:
    name: str = MISSING


@dataclass
class FaultConfig:
    name: str = MISSING


@dataclass
class CheckpointConfig:
    """Formats written beside plait's own checkpoints (``fault``), e.g. Hugging Face's."""

    name: str = MISSING


@dataclass
class TrackerConfig:
    name: str = MISSING


@dataclass
class TuneConfig:
    name: str = MISSING


@dataclass
class EvalConfig:
    """Downstream tasks scored on the model (``plait eval``, and during training)."""

    name: str = MISSING


@dataclass
class PlaitConfig:
    """The whole config. Each field left ``MISSING`` is a config group, filled by the option
    ``config.yaml``'s defaults list (or the user) chooses, with the field's type as the group's
    base schema (``GROUP_SCHEMAS``); the rest are the core's own sections and settings."""

    strategy: StrategyConfig = MISSING
    parallel: ParallelConfig = MISSING
    tensor_parallel: TensorParallelConfig = MISSING
    expert_parallel: ExpertParallelConfig = MISSING
    context_parallel: ContextParallelConfig = MISSING
    pipeline: PipelineConfig = MISSING
    comm: CommConfig = MISSING
    data: DataConfig = MISSING
    model: ModelConfig = MISSING
    optimizer: OptimizerConfig = MISSING
    fault: FaultConfig = MISSING
    checkpoint: CheckpointConfig = MISSING
    tracker: TrackerConfig = MISSING
    launcher: LauncherConfig = MISSING
    tune: TuneConfig = MISSING
    eval: EvalConfig = MISSING
    train: TrainConfig = field(default_factory=TrainConfig)
    run: RunConfig = field(default_factory=RunConfig)
    seed: int = 1337
    precision: str = "fp32"
    device: str = "auto"  # auto: cuda when available, else cpu
    # auto: continue from this run directory's newest complete checkpoint if there is one;
    # latest: the same, but one must exist; a checkpoint / run directory; null: start fresh
    resume: Optional[str] = "auto"
    plugins: list[str] = field(default_factory=list)  # dotted paths of in-house plugins


GROUP_SCHEMAS: dict[str, type] = {
    f.name: get_type_hints(PlaitConfig)[f.name] for f in fields(PlaitConfig) if f.default is MISSING
}
"""Each config group and its base schema, read off :class:`PlaitConfig` (the one list)."""
GROUPS = tuple(GROUP_SCHEMAS)


@dataclass(frozen=True)
class Range:
    """The values a numeric setting accepts: ``low <= value <= high``, strict where ``*_open``;
    a None bound is no bound. ``meaning`` explains a boundary value, e.g. ``"0 turns it off"``.

    The type (int, float) is the schema's job; a range is what the type cannot say. Tables of
    ranges sit beside each schema and are checked by :func:`range_problems` before launch.
    """

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    meaning: str = ""

    def admits(self, value: float) -> bool:
        above = self.low is None or (value > self.low if self.low_open else value >= self.low)
        below = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return above and below

    def __str__(self) -> str:
        if self.low is not None and self.high is not None:
            text = (
                f"in {'(' if self.low_open else '['}{self.low}, {self.high}"
                f"{')' if self.high_open else ']'}"
            )
        elif self.low is not None:
            text = f"{'>' if self.low_open else '>='} {self.low}"
        else:
            text = f"{'<' if self.high_open else '<='} {self.high}"
        return f"{text} ({self.meaning})" if self.meaning else text


AT_LEAST_0 = Range(0)
AT_LEAST_1 = Range(1)
POSITIVE = Range(0, low_open=True)


def range_problems(section: str, settings: Any, ranges: Mapping[str, Range]) -> list[str]:
    """One problem per setting of ``settings`` (the config section called ``section``, "" for the
    top level) outside its range, naming the setting and the values it takes; None (an optional
    setting left unset) passes, and a list is checked element by element.
    """
    prefix = f"{section}." if section else ""
    problems = []
    for key, allowed in ranges.items():
        value = settings[key]
        is_list = isinstance(value, (list, tuple, ListConfig))
        if all(v is None or allowed.admits(v) for v in (value if is_list else [value])):
            continue
        problems.append(
            f"{prefix}{key}={value} is out of range: set "
            f"{'each of ' if is_list else ''}{prefix}{key} {allowed}"
        )
    return problems


class SchemaStore:
    """Hydra's ConfigStore as ``plait_register_configs`` and the core store into it, storing a
    schema class again only when the store no longer holds what it made of it.

    Every plan stores every schema (the core's and the plugins', ~55 dataclasses), and Hydra's
    ``ConfigStore.store`` turns each into a DictConfig: 0.15 s of each plan, paid again by each
    plan of a long-lived process (a test session, a sweep). A class stored before with the
    same group, name, package and provider, whose node the store still holds (no one stored
    another in its place), is the same schema: what Hydra made of it is kept. Instances and
    dicts, which may have changed since, are stored as given. Everything else a plugin reads
    from the ConfigStore is the ConfigStore's own."""

    # this process's: (group, name) -> (the class, the ConfigNode Hydra made of it)
    made: dict[tuple[str | None, str], tuple[type, Any]] = {}

    def __init__(self, cs: ConfigStore) -> None:
        self.cs = cs

    def store(
        self,
        name: str,
        node: Any,
        group: str | None = None,
        package: str | None = None,
        provider: str | None = None,
    ) -> None:
        made, held = self.made.get((group, name), (None, None)), self.held(group, name)
        if (
            isinstance(node, type)
            and made[0] is node
            and made[1] is held
            and (held.package, held.provider) == (package, provider)
        ):
            return
        self.cs.store(name=name, node=node, group=group, package=package, provider=provider)
        if isinstance(node, type):
            self.made[(group, name)] = (node, self.held(group, name))

    def held(self, group: str | None, name: str) -> Any:
        found: Any = self.cs.repo
        for key in [*(group.split("/") if group else []), f"{name.removesuffix('.yaml')}.yaml"]:
            found = found.get(key) if isinstance(found, dict) else None
        return found

    def __getattr__(self, attribute: str) -> Any:
        return getattr(self.cs, attribute)


def store_core_schemas(cs: ConfigStore | SchemaStore) -> None:
    cs.store(name="base_config", node=PlaitConfig)
    for group, node in GROUP_SCHEMAS.items():
        cs.store(group=group, name=f"base_{group}", node=node)
