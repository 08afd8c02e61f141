"""The small data types that cross the hook boundary.

Plugins return these from hooks and the core passes them between hooks; keeping them here lets a
plugin author read every contract in two files: this one and ``hookspecs.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Mapping, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

ALL_DEVICES = frozenset({"cpu", "cuda"})
ALL_PRECISIONS = frozenset({"fp32", "bf16", "fp16"})
ALL_AXES = frozenset({"dp", "cp", "tp", "pp", "ep"})


ALWAYS = "always"
"""The ``PluginInfo.requires`` key for needs that hold whatever the parallel layout."""


@dataclass(frozen=True)
class PluginInfo:
    """A plugin's self-description, returned by ``plait_declare``.

    ``selected_by`` maps config paths to the value that turns the plugin on, e.g.
    ``{"strategy.name": "ddp"}``; a plugin with an empty mapping is active in every run it is
    loaded into. The capability fields list what the plugin works with; the core refuses a plan in
    which an active plugin meets a device, precision or parallel axis (with size > 1) it does not
    list, or another active plugin it ``excludes``.

    Plugins meet each other through capabilities, never through each other's names:
    ``provides`` lists what this plugin offers the others (``"engine:pipeline"``: a strategy
    whose engine a pipeline can drive), and ``requires`` maps a parallel axis (``"dp"``,
    ``"tp"``, ``"pp"``, ``"ep"``: needed while that axis is larger than 1) or :data:`ALWAYS` to the
    capabilities some active plugin must provide. ``docs/architecture.md`` lists the built-in
    capability names; a third-party plugin may use them or coin its own.

    ``renamed`` maps the names this plugin's settings had before a release moved them to their
    names now (``{"fault.checkpoint_every": "checkpoint.every"}``): an override with an old name
    keeps working, with a ``FutureWarning`` (:mod:`plait.renames`).

    ``preload`` names the modules this plugin's hooks import in every worker (``"deepspeed"``),
    or a module of the plugin's that prepares at import what every worker would build: a
    launcher that forks workers from a preloaded server imports them there once, and only for
    runs in which the plugin is active.
    """

    name: str
    selected_by: Mapping[str, Any] = field(default_factory=dict)
    devices: frozenset[str] = ALL_DEVICES
    precisions: frozenset[str] = ALL_PRECISIONS
    parallel_axes: frozenset[str] = ALL_AXES
    excludes: frozenset[str] = frozenset()
    provides: frozenset[str] = frozenset()
    requires: Mapping[str, frozenset[str]] = field(default_factory=dict)
    description: str = ""
    renamed: Mapping[str, str] = field(default_factory=dict)
    preload: frozenset[str] = frozenset()


@dataclass
class StepOutput:
    """What an engine reports for one optimizer step; ``loss`` is the mean over the global batch.

    ``metrics`` holds any further figures the engine measures (e.g. a loss scale, bytes of model
    states per rank); they are logged with the step's metrics under their own names.
    ``skipped``: a ``plait_check_step`` guard stopped the optimizer step on every rank
    (parameters and optimizer state untouched); the loop does not count the step.
    ``timings``: this rank's seconds in each phase of the step (``forward_s``, ``backward_s``,
    ``optimizer_s``, ``comm_wait_s``), filled by a timing plugin (``plugins/fault/phases.py``);
    the core gathers them per rank on logged steps (``plait.metrics.StepMeter``).
    """

    loss: float
    grad_norm: float
    metrics: dict[str, float] = field(default_factory=dict)
    skipped: bool = False
    timings: dict[str, float] = field(default_factory=dict)


@dataclass
class TrainState:
    """Everything besides model and optimizer that a resumed run needs to continue exactly."""

    step: int = 0
    tokens_seen: int = 0
    data: dict[str, Any] = field(default_factory=dict)
    tracker_run_id: str | None = None
    run_name: str | None = None  # the run that wrote the checkpoint
    # The run this one was started from, when it resumed another run's checkpoint (a PBT child,
    # a fine-tune): its ``run_name``, ``tracker_run_id`` and ``step``.
    parent: dict[str, Any] | None = None
    metrics: dict[str, float] = field(default_factory=dict)  # last logged value of each metric

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "data": self.data,
            "tracker_run_id": self.tracker_run_id,
            "run_name": self.run_name,
            "parent": self.parent,
            "metrics": self.metrics,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TrainState:
        return cls(
            step=d["step"],
            tokens_seen=d["tokens_seen"],
            data=dict(d["data"]),
            tracker_run_id=d.get("tracker_run_id"),
            run_name=d.get("run_name"),
            parent=d.get("parent"),
            metrics=dict(d.get("metrics") or {}),
        )


@dataclass(frozen=True)
class CommSpec:
    """How a run communicates gradients, as the comm plugin describes it (``plait_comm_spec``).

    Engines that cannot call a reducer (DeepSpeed reduces gradients itself) map these fields
    onto their backend's settings or refuse the plan; ``plait plan`` prints them.

    ``algorithm``: ``"allreduce"`` (the strategy's own all-reduce), ``"flat"``, ``"ring"``,
    ``"hierarchical"``, or a third-party plugin's own name. ``compression``: ``"none"``,
    ``"fp16"``, ``"bf16"`` or ``"powersgd"``. ``bucket_bytes``: the size of the flat buffers
    gradients are fused into before they are reduced; None leaves each engine its default (DDP's
    25 MiB, DeepSpeed's ``reduce_bucket_size``).
    """

    algorithm: str
    compression: str = "none"
    bucket_bytes: int | None = None

    @property
    def native(self) -> bool:
        """The strategy's own all-reduce is the algorithm: an engine may run its built-in path
        (DDP's C++ reducer) instead of calling the reducer, with the same result."""
        return self.algorithm == "allreduce"


@dataclass(frozen=True)
class StrategyCost:
    """What one rank of a strategy holds and sends per optimizer step, as the strategy plugin
    estimates it (``plait_strategy_cost``), for ``plait estimate`` and ``plait plan --search``.

    ``params``, ``grads``, ``optimizer``: model-state bytes, split as the ZeRO paper splits
    them; ``buffers``: the engine's own working memory (gradient buckets, gathered parameters);
    ``offloaded``: which of ``"params"`` and ``"optimizer"`` live in host memory instead of the
    device's; ``dp_bytes_per_step``: what the rank sends over its data-parallel group per step;
    ``references``: other estimators' per-rank device bytes by name (e.g. DeepSpeed's own).
    """

    params: int
    grads: int
    optimizer: int
    buffers: int = 0
    dp_bytes_per_step: float = 0.0
    offloaded: frozenset[str] = frozenset()
    references: Mapping[str, int] = field(default_factory=dict)

    @property
    def states(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def device_bytes(self) -> int:
        """Bytes on the device: model states not offloaded, plus the buffers."""
        kept = {"params": self.params, "grads": self.grads, "optimizer": self.optimizer}
        return sum(v for k, v in kept.items() if k not in self.offloaded) + self.buffers


@dataclass(frozen=True)
class AxisCost:
    """What one rank's share of a parallel axis costs per optimizer step, as the plugin that
    carries the axis out estimates it (``plait_axis_cost``), for ``plait plan --search``.

    ``bytes_per_step``: what the rank sends over the axis per step (activations, gradients,
    attention exchanges, token dispatches); ``in_flight``: how many micro-batches' activations
    the rank holds at once (a pipeline schedule's: 1 elsewhere).
    """

    bytes_per_step: float
    in_flight: int = 1


class GradBucket(Protocol):
    """A flat gradient buffer and the gradients it holds, in the shape of
    ``torch.distributed.GradBucket`` (what DDP hands a comm hook), so torch's comm hooks run on it.
    """

    def index(self) -> int:
        """Which bucket this is in a step (stable across steps and ranks)."""

    def buffer(self) -> torch.Tensor:
        """The flat (1-D) buffer to reduce."""

    def gradients(self) -> list[torch.Tensor]:
        """Views of ``buffer()`` shaped like each parameter's gradient."""

    def is_last(self) -> bool:
        """True for the last bucket reduced in a step."""

    def set_buffer(self, buffer: torch.Tensor) -> None:
        """Replace the buffer (compression casts it)."""


class GradReducer(Protocol):
    """The comm plugins' contract, strategy-neutral (``plait_grad_reducer``): average a flat
    gradient buffer over a group, asynchronously.

    DDP adapts it as a comm hook on its buckets, the pipeline engine calls it on each stage's
    gradient buckets after the schedule, and any other data-parallel engine (a parameter server,
    local SGD) may call it the same way: hand over buckets in the same order on every rank of
    ``group``, then wait for every future before reading the gradients.
    """

    spec: CommSpec

    def reduce(
        self, bucket: GradBucket, group: dist.ProcessGroup
    ) -> torch.futures.Future[torch.Tensor]:
        """Start averaging ``bucket.buffer()`` over ``group``; the future's value is the averaged
        flat buffer (the bucket's own buffer, written in place)."""


Batch = tuple["torch.Tensor", ...]
"""``(inputs, targets)``: token ids and next-token targets, both ``[micro_batch_size, seq_len]``
int64; or, with packed documents (``data.pack=true``), ``(inputs, targets, position_ids)``:
each token's position within its document, restarting at 0 where a document starts (HF's
``position_ids`` of packed sequences), from which the model masks attention across documents."""


def model_inputs(batch: Batch, device: torch.device) -> tuple[torch.Tensor, dict, torch.Tensor]:
    """``(inputs, keyword arguments of the model's forward, targets)`` of ``batch`` on
    ``device`` (copied without blocking): a packed batch's positions go to the model as
    ``position_ids=``, what an engine calls ``model(inputs, **kwargs)`` with."""
    inputs, targets, *rest = (t.to(device, non_blocking=True) for t in batch)
    return inputs, ({"position_ids": rest[0]} if rest else {}), targets


class Engine(Protocol):
    """A model and its optimizer wrapped for one parallel strategy (DDP, DeepSpeed, a pipeline).

    The surface is deliberately small (Lightning Fabric's lesson): one optimizer step over the
    micro-batches of a global batch, an evaluation loss, and collective save/load of the sharded
    model and optimizer state.

    Two optional attributes the checkpoint plugin reads where an engine has them (with
    ``engine:layout_free_state``): ``saves_engine_files`` (False: its own files cannot hold this
    layout, so only the layout-free copy is written) and ``own_files_mismatch(directory) -> str
    | None`` (a setting other than the layout, as ``key=value``, with which its own files in a
    checkpoint were written and cannot be loaded: the layout-free copy is loaded instead).
    """

    model: torch.nn.Module

    def train_step(self, micro_batches: list[Batch], lr: float) -> StepOutput:
        """Forward/backward every micro-batch (accumulating), clip, step; return global loss."""

    def eval_loss(self, batch: Batch) -> float:
        """Mean loss of ``batch`` without touching gradients, reduced over data-parallel ranks."""

    def save_state(self, directory: Path) -> None:
        """Write model and optimizer state into ``directory``; called on every rank."""

    def load_state(self, directory: Path) -> None:
        """Read back what ``save_state`` wrote; called on every rank."""


# Optional engine surfaces. A strategy whose engine has one declares its capability in
# ``PluginInfo.provides``; the plan matches it with the plugins that require it before launch, so
# the code that calls these methods trusts the plan instead of probing the engine at run time.
# When the engine is built the core checks it against every surface its plugins declared
# (:func:`engine_problems`), so a plugin that declares more than it implements is named at start.


@runtime_checkable
class LayoutFreeStateEngine(Protocol):
    """``engine:layout_free_state``: model and optimizer state by the unsplit model's parameter
    names, so a checkpoint saves in the background and loads at another layout
    (the checkpoint plugin's ``layout_free.py``)."""

    def layout_free_state(self) -> dict[str, Any]:
        """This rank's part of the state, keyed by unsplit parameter names (DCP's form)."""

    def load_layout_free_state(self, state: dict[str, Any]) -> None:
        """Take back a state of that form (loaded by DCP into ``layout_free_state()``'s)."""


@runtime_checkable
class PipelineDrivenEngine(Protocol):
    """``engine:pipeline``: an engine a pipeline schedule can drive. Its ``model`` is this
    rank's stages (``PipelineStageModules``); the pipeline engine sets the learning rate on
    ``optimizer``, runs the schedule's forwards and backwards itself, and leaves the files to
    ``save_state``/``load_state``. After the backward it hands the step to the engine
    (:class:`SelfSteppingEngine`) or, for an engine that does not step itself, averages,
    clips and steps ``optimizer`` (:class:`LossScaledEngine`)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer

    def save_state(self, directory: Path) -> None: ...

    def load_state(self, directory: Path) -> None: ...


@runtime_checkable
class SelfSteppingEngine(Protocol):
    """``engine:pipeline_step``: after a pipeline schedule's backward the engine reduces the
    gradients over dp, clips and steps itself (DeepSpeed ZeRO-1's partitioned optimizer)."""

    def step_after_backward(self, loss: float, local_loss: torch.Tensor) -> StepOutput:
        """``loss``: the global mean; ``local_loss``: this rank's (what the step guard sees)."""


@runtime_checkable
class LossScaledEngine(Protocol):
    """An ``engine:pipeline`` engine without ``engine:pipeline_step``: the pipeline engine steps
    its optimizer and scales the schedule's loss with ``scaler`` (a ``torch.amp.GradScaler``,
    enabled under fp16 only), counting the steps an overflow skipped in ``skipped_steps``, which
    the engine checkpoints."""

    scaler: torch.amp.GradScaler
    skipped_steps: int


class ReplicaSync(Protocol):
    """What an engine asks, inside its step, of the layer that runs its replica groups as
    independent torch jobs (``fault=torchft``): gradients averaged over the groups the step's
    quorum admits, and whether the step is taken. Set on the engine as ``engine.replicas``."""

    def average(self, tensor: torch.Tensor) -> torch.Tensor:
        """Average ``tensor`` in place over the same rank of every group in the step's quorum
        (the sum divided by their number); returns it."""

    def participants(self) -> int:
        """How many groups the step's quorum admits (known once the step's quorum is formed,
        before its backward)."""

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` in place over the same rank of every group in the step's quorum (for
        a caller that divided it by :meth:`participants` in a pass of its own); returns it."""

    def commit(self, ok: bool) -> bool:
        """Whether this group takes the step: ``ok`` is this rank's verdict (no guard skipped
        it), agreed over the group's ranks and with the quorum's health (a group whose
        collectives failed in this step does not take it)."""


@runtime_checkable
class ReplicaGroupEngine(Protocol):
    """``engine:replica_groups``: an engine whose replica groups can run as independent torch
    jobs. It averages its gradients over the groups through ``replicas`` (a
    :class:`ReplicaSync`, None when the job runs as one) and commits its step through it, and it
    hands over and takes back this rank's own state as plain tensors, with no collective, so a
    peer at the same place in another group can continue from it bit for bit."""

    replicas: ReplicaSync | None

    def local_state(self) -> dict[str, Any]:
        """This rank's model and optimizer state (and loss scaler), as its own files hold it."""

    def load_local_state(self, state: dict[str, Any]) -> None:
        """Take back what a peer's :meth:`local_state` returned."""


ENGINE_SURFACES: dict[str, type] = {
    "engine:layout_free_state": LayoutFreeStateEngine,
    "engine:replica_groups": ReplicaGroupEngine,
}
"""The capabilities that promise methods on the engine the train loop gets, and their surface.
(``engine:pipeline``'s surfaces are those of the engine a pipeline wraps; the pipeline plugin
checks them.)"""


def engine_problems(
    engine: Any,
    declared: Iterable[tuple[str, PluginInfo]],
    surfaces: Mapping[str, type] = ENGINE_SURFACES,
) -> list[str]:
    """The surfaces ``engine`` lacks of those its plugins declare: ``declared`` holds
    ``(capability, declaring plugin)`` pairs; one problem per missing surface, naming the plugin
    and the methods or attributes it lacks."""
    problems = []
    for capability, info in declared:
        surface = surfaces.get(capability)
        if surface is None or isinstance(engine, surface):
            continue
        members = {
            *vars(surface).get("__annotations__", {}),
            *(name for name, value in vars(surface).items() if callable(value)),
        }
        missing = sorted(m for m in members if not m.startswith("_") and not hasattr(engine, m))
        problems.append(
            f"plugin {info.name!r} declares {capability!r}, but its engine "
            f"{type(engine).__name__} lacks {', '.join(missing)}: "
            f"implement {surface.__name__} (plait.types) or drop the capability"
        )
    return problems


class TokenDataset(Protocol):
    """Fixed-length training samples (ids ``0 .. len-1``) cut from token streams.

    A dataset may also define ``epoch_order(seed, epoch) -> array of ids``, the order of its
    samples in an epoch (e.g. shard-local shuffling, a weighted blend); without it the built-in
    sampler permutes the ids with a seeded RNG.
    """

    seq_len: int

    def __len__(self) -> int: ...

    def batch(self, indices: list[int]) -> Batch: ...


class BatchLoader(Protocol):
    """Yields, per optimizer step, this rank's ``grad_accum_steps`` micro-batches, ready to
    train on (pinned on CUDA), typically made ahead in the background.

    Its state is small and layout-free, keyed by global sample position: the built-in loader's
    is ``{"consumed_samples": c}``, the samples all data-parallel ranks together have taken.
    A state saved at one data-parallel size loads at another and continues at the same
    position (nothing repeated or skipped).
    """

    def __iter__(self) -> Iterator[list[Batch]]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


class Tokenizer(Protocol):
    """Text to token ids and back, as a run's data was tokenized (``plait_tokenizer``).

    ``identity`` is the same string for the same tokenizer (``bytes-v1``, or the SHA-256 of a
    ``tokenizer.json``'s serialisation), so two tokenizers compare by it.
    """

    name: str
    identity: str
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class PlanError(ValueError):
    """A composed configuration that cannot run; raised before any worker starts."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("plait refused this plan:\n" + "\n".join(f"  - {p}" for p in problems))
