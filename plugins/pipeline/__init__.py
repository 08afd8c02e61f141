"""``parallel.pp>1`` (``pipeline=torch``, the default): pipeline parallelism through
``torch.distributed.pipelining``.

The model's layers are cut into ``pp`` stages (``pp × virtual_stages`` for the interleaved and
zero-bubble schedules), one rank of the pipeline group per stage (see
:mod:`plait.plugins.pipeline.split` for the plan and the balance), and every optimizer step runs
the chosen schedule over ``pipeline.microbatches`` micro-batches::

    pipeline.schedule   torch schedule                  stages per rank  placement of stage s
    gpipe               ScheduleGPipe                   1                rank s
    1f1b                Schedule1F1B                    1                rank s
    interleaved_1f1b    ScheduleInterleaved1F1B         v >= 2           rank s mod pp
    zero_bubble         ScheduleInterleavedZeroBubble   v >= 1           rank s mod pp
    zbv                 ScheduleZBVZeroBubble           v = 2            rank s, or 2pp-1-s ("V")

Batching: the global batch is ``train.batch_size`` whatever ``pp`` is. Each data-parallel rank
takes ``batch_size / dp`` sequences and the schedule cuts them into ``microbatches`` pipeline
micro-batches; these *are* the step's gradient-accumulation micro-batches, so
``train.grad_accum_steps`` is set to ``pipeline.microbatches`` (a different explicit value is
refused). Gradients are the mean over the micro-batches (the schedule scales by ``1/m``), then
averaged over data-parallel ranks: the same gradient as one process on the whole batch.

The engine wraps the strategy's engine (``plait_build_engine`` wrapper): it keeps that engine's
optimizer and checkpoint files (``model_pp{p}_tp{t}.pt``, original parameter names) and replaces
only the forward/backward with the schedule; the data-parallel gradient average follows the
schedule: the stage's gradients in ``comm.bucket_mb`` buckets, each averaged over the dp group by
the comm plugin's reducer (see ``docs/architecture.md``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from plait import hookimpl
from plait.config import AT_LEAST_1, PipelineConfig, range_problems
from plait.engine.stages import PipelineStageModules
from plait.meta import meta_model
from plait.plugin_manager import offered_by, provided
from plait.plugins.pipeline.schedules import (
    SCHEDULES,
    schedule_problems,
    stage_to_rank,
    stages_per_rank,
)
from plait.plugins.pipeline.split import (
    BALANCES,
    PipelinePlan,
    build_stage_modules,
    measure_part_times,
    model_plan,
    part_modules,
    split_stages,
)
from plait.types import (
    AxisCost,
    LossScaledEngine,
    PipelineDrivenEngine,
    PluginInfo,
    SelfSteppingEngine,
    engine_problems,
)

PIPELINE, SELF_STEPPING = "engine:pipeline", "engine:pipeline_step"
STEPPED_HERE = "engine:pipeline without engine:pipeline_step"
# What the engine a pipeline wraps must have, by what its strategy declares.
INNER_SURFACES = {
    PIPELINE: PipelineDrivenEngine,
    SELF_STEPPING: SelfSteppingEngine,
    STEPPED_HERE: LossScaledEngine,
}
# Schedules whose backward is split into input and weight parts, and the capability of an engine
# whose gradients stay right under them (this plugin averages DDP's itself, after the schedule;
# DeepSpeed's ZeRO-1 reduces after it too; FSDP under torch's PipelineStage does not declare it).
SPLIT_BACKWARD = ("zero_bubble", "zbv")
SPLIT_BACKWARD_SAFE = "engine:split_backward"


@dataclass
class TorchPipelineConfig(PipelineConfig):
    name: str = "torch"
    schedule: str = "1f1b"  # gpipe | 1f1b | interleaved_1f1b | zero_bubble | zbv
    microbatches: int = 1  # pipeline micro-batches per optimizer step
    virtual_stages: int = 1  # stages per rank (interleaved and zero-bubble schedules)
    balance: Any = "layers"  # layers | params | time | [layers per stage, ...]
    # The model's layer list (a ModuleList or ModuleDict, e.g. transformer.h) for a model without
    # a pipeline_plan of its own; None: the model's pipeline_plan.
    layers: Optional[str] = None


RANGES = {"microbatches": AT_LEAST_1, "virtual_stages": AT_LEAST_1}


# ---------------------------------------------------------------------------------------------
# before launch
# ---------------------------------------------------------------------------------------------


@hookimpl
def plait_declare() -> PluginInfo:
    return PluginInfo(
        name="pipeline",
        selected_by={"pipeline.name": "torch"},
        requires={"pp": frozenset({PIPELINE})},
        description="pipeline stages + schedules via torch.distributed.pipelining",
    )


@hookimpl
def plait_register_configs(config_store) -> None:
    config_store.store(group="pipeline", name="base_torch_pipeline", node=TorchPipelineConfig)


@hookimpl
def plait_configure(cfg) -> None:
    """The pipeline micro-batches are the step's gradient-accumulation micro-batches."""
    if cfg.parallel.pp > 1 and cfg.train.grad_accum_steps == 1:
        cfg.train.grad_accum_steps = cfg.pipeline.microbatches


def balance_problems(par, n_blocks: int | None, n_stages: int) -> list[str]:
    balance = par.balance
    if isinstance(balance, str):
        if balance not in BALANCES:
            return [
                f"pipeline.balance={balance}: choose one of {', '.join(BALANCES)} or a list "
                "of layer counts per stage, e.g. pipeline.balance=[3,5]"
            ]
        return []
    counts = list(balance)
    if len(counts) != n_stages or min(counts) < 1 or (n_blocks and sum(counts) != n_blocks):
        return [
            f"pipeline.balance={counts} must list {n_stages} layer counts (one per pipeline "
            f"stage), each at least 1, adding up to the model's {n_blocks} layers"
        ]
    return []


def shared_across_stages(model: torch.nn.Module, plan: PipelinePlan) -> bool:
    """True when a parameter of the first parts is also one of the last (tied embeddings): the
    two would sit on different stages."""
    first, _, last = part_modules(model, plan)
    ids = {id(p) for m in first for p in m.parameters()}
    return any(id(p) in ids for m in last for p in m.parameters())


def outside_plan(model: torch.nn.Module, plan: PipelinePlan) -> list[str]:
    """Parameters no stage part holds (every stage would keep its own copy)."""
    roots = (*plan.first, plan.layers, *plan.last)
    return [
        name
        for name, _ in model.named_parameters()
        if not any(name.startswith(root + ".") for root in roots)
    ]


def plan_problems(cfg, model: torch.nn.Module, pp: int) -> tuple[PipelinePlan | None, list[str]]:
    """The model's pipeline plan and what is wrong with it."""
    what = f"model._target_={cfg.model._target_}"
    reason = getattr(model, "no_pipeline_plan_reason", None)  # a model that cannot be cut
    if reason is not None:
        return None, [f"parallel.pp={pp}: {reason}: set parallel.pp=1"]
    try:
        plan = model_plan(model, cfg.pipeline.layers)
    except ValueError as e:
        return None, [str(e)]
    if plan is None:
        return None, [
            f"parallel.pp={pp}: {what} has no pipeline_plan: name its layer list (a "
            "ModuleList or ModuleDict of its repeated layers) with pipeline.layers=<"
            "module name>, or set parallel.pp=1"
        ]
    try:
        part_modules(model, plan)
    except (ValueError, AttributeError) as e:
        return None, [f"parallel.pp={pp}: {e}"]
    outside = outside_plan(model, plan)
    if outside:
        return None, [
            f"parallel.pp={pp}: parameters of {what} belong to no pipeline stage's "
            f"part ({outside[:4]}): name a layer list whose first and last parts hold "
            "every parameter, or set parallel.pp=1"
        ]
    if cfg.pipeline.balance == "time" and not plan.layers_run_alone:
        return None, [
            f"pipeline.balance=time times each layer alone, which {what}'s layers "
            "cannot run (they take more than the previous layer's output from the "
            "model's forward): use pipeline.balance=layers or params"
        ]
    return plan, []


@hookimpl
def plait_validate(cfg, dims, hook) -> list[str]:
    settings, pp = cfg.pipeline, dims.pp
    problems = range_problems("pipeline", settings, RANGES)
    if pp == 1 or problems:
        return problems
    problems = schedule_problems(settings, pp)
    if settings.schedule in SPLIT_BACKWARD and SPLIT_BACKWARD_SAFE not in provided(hook):
        problems.append(
            f"pipeline.schedule={settings.schedule} with strategy="
            f"{cfg.strategy.name}: the zero-bubble schedules split each backward "
            "into input and weight gradients, which this strategy's engine does not "
            f"declare it survives ({SPLIT_BACKWARD_SAFE!r}); use pipeline.schedule="
            f"1f1b, gpipe or interleaved_1f1b, or {offered_by(SPLIT_BACKWARD_SAFE)}"
        )
    model = meta_model(hook, cfg)
    if problems or model is None:  # a model that cannot be built: the models plugin says why
        return problems
    plan, problems = plan_problems(cfg, model, pp)
    if plan is None:
        return problems
    n_stages = pp * stages_per_rank(cfg)
    n_blocks = len(part_modules(model, plan)[1])
    if n_stages > n_blocks:
        problems.append(
            f"parallel.pp={pp} x {n_stages // pp} stage(s) per rank = {n_stages} "
            f"pipeline stages, but the model has {n_blocks} layers: each stage needs "
            "one; lower parallel.pp / pipeline.virtual_stages or add layers"
        )
    problems += balance_problems(settings, n_blocks, n_stages)
    if settings.balance == "time" and dims.cp > 1:
        problems.append(
            f"pipeline.balance=time with parallel.cp={dims.cp}: the profiling pass "
            "times each part alone, which context-parallel attention (an exchange "
            "among ranks) cannot do: use pipeline.balance=layers or params"
        )
    if settings.balance == "time" and "fault:replica_groups" in provided(hook):
        problems.append(
            f"pipeline.balance=time with fault={cfg.fault.name}: each replica group runs as a "
            "torch job of its own and would time, and cut, its stages on its own, so groups "
            "could hold different layers; use pipeline.balance=layers or params"
        )
    per_dp = cfg.train.batch_size // dims.dp
    if per_dp % settings.microbatches:
        problems.append(
            f"pipeline.microbatches={settings.microbatches} does not divide the batch "
            f"of each data-parallel rank (train.batch_size={cfg.train.batch_size} / "
            f"dp={dims.dp} = {per_dp}): choose a divisor of {per_dp}"
        )
    if cfg.train.grad_accum_steps != settings.microbatches:
        problems.append(
            f"train.grad_accum_steps={cfg.train.grad_accum_steps} with parallel.pp="
            f"{pp}: the pipeline micro-batches are the step's accumulation micro-"
            f"batches; leave train.grad_accum_steps unset (1) or equal to "
            f"pipeline.microbatches={settings.microbatches}"
        )
    if dims.elastic:
        problems.append(
            f"launcher.nnodes={cfg.launcher.nnodes} with parallel.pp={pp}: a smaller "
            "world keeps the global batch by accumulating more micro-batches, but "
            "the schedule's pipeline.microbatches is fixed; use a fixed "
            "launcher.nnodes, or parallel.pp=1"
        )
    if shared_across_stages(model, plan):
        problems.append(
            f"parallel.pp={pp} with a parameter shared by the embedding and the head "
            "(tied embeddings): they live on different stages; untie them (for "
            "plait's GPT: model.tie_embeddings=false)"
        )
    if problems or settings.balance == "time":  # time: the counts are measured at launch
        return problems
    from plait.plugins.pipeline.fidelity import stage_composition_problems

    split = split_stages(model, n_stages, balance_of(settings), plan=plan)
    return stage_composition_problems(cfg, model, plan, split)


# ---------------------------------------------------------------------------------------------
# build
# ---------------------------------------------------------------------------------------------


def profile_sample(cfg, model: torch.nn.Module, dp: int) -> torch.Tensor:
    """One micro-batch of random token ids, for the ``time`` balance's profiling pass."""
    micro = max(1, cfg.train.batch_size // (dp * cfg.pipeline.microbatches))
    vocab = next(m for m in model.modules() if isinstance(m, torch.nn.Embedding)).num_embeddings
    generator = torch.Generator().manual_seed(cfg.seed)
    return torch.randint(0, vocab, (micro, cfg.train.seq_len), generator=generator)


def balance_of(settings):
    """``pipeline.balance`` as :func:`split_stages` takes it: a name or a list of counts."""
    balance = settings.balance
    return balance if isinstance(balance, str) else list(balance)


@hookimpl
def plait_split_pipeline(cfg, model, topology) -> PipelineStageModules | None:
    pp = topology.dims.pp
    if pp == 1:
        return None
    style = SCHEDULES[cfg.pipeline.schedule][2]
    n_stages = pp * stages_per_rank(cfg)
    balance = balance_of(cfg.pipeline)
    plan = model_plan(model, cfg.pipeline.layers)
    part_times = None
    if balance == "time":
        sample = profile_sample(cfg, model, topology.dims.data_parallel)
        times = torch.tensor(measure_part_times(model, sample, plan=plan), dtype=torch.float64)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)  # every rank must cut the same way
        part_times = times.tolist()
    split = split_stages(model, n_stages, balance, part_times, plan=plan)
    placement = stage_to_rank(pp, n_stages, style)
    if topology.is_logging_rank:
        print(split.describe(placement, plan), flush=True)
    mine = [s for s in range(n_stages) if placement[s] == topology.pp_rank]
    return build_stage_modules(model, split, mine, plan=plan)


@hookimpl(wrapper=True)
def plait_build_engine(cfg, loss_fn, grad_reducer, topology, hook):
    """Wrap the strategy's engine when the model was cut into pipeline stages."""
    engine = yield
    if topology.dims.pp == 1 or engine is None:
        return engine
    if not isinstance(engine.model, PipelineStageModules):
        raise ValueError(
            "parallel.pp>1 but the model was not split by the pipeline plugin: "
            "another plugin answered plait_split_pipeline; set pipeline=torch"
        )
    from plait.plugins.pipeline.engine import PipelineEngine

    inner_steps = SELF_STEPPING in provided(hook)
    strategies = [info for info in hook.plait_declare() if PIPELINE in info.provides]
    stepping = SELF_STEPPING if inner_steps else STEPPED_HERE
    problems = engine_problems(
        engine, [(c, info) for info in strategies for c in (PIPELINE, stepping)], INNER_SURFACES
    )
    if problems:
        raise TypeError("; ".join(problems))
    return PipelineEngine(cfg, engine, loss_fn, grad_reducer, topology, hook, inner_steps)


@hookimpl
def plait_axis_cost(
    cfg, axis, model, dims, seq_len, micro_batch_size, microbatches, bytes_per_value
) -> AxisCost | None:
    """What pipeline stages cost per step (``plait plan --search``): a stage sends its
    activations forward and their gradients backward, ``2·s/cp·b·h·v`` bytes per micro-batch;
    the first stage holds the activations of ``min(m, pp)`` micro-batches under 1F1B-like
    schedules, all ``m`` under GPipe."""
    if axis != "pp" or cfg.pipeline.name != "torch":
        return None
    activation_msg = (
        seq_len // dims.cp * micro_batch_size * getattr(model, "n_embd", 0) * bytes_per_value
    )
    in_flight = microbatches if cfg.pipeline.schedule == "gpipe" else min(microbatches, dims.pp)
    return AxisCost(2 * activation_msg * microbatches, in_flight=in_flight)
