"""``parallel.cp=C`` (``context_parallel=plait``, the default): context parallelism, each sequence
split over ``C`` ranks, with plait's own attention exchange.

    plait train parallel.cp=2 launcher.nproc_per_node=2                                   # ring
    plait train parallel.cp=4 context_parallel.backend=ulysses launcher.nproc_per_node=4
    plait train parallel.cp=2 parallel.tp=2 launcher.nproc_per_node=8                     # + dp=2

``context_parallel.backend=ring`` (:mod:`.ring`): ring attention, keys and values passed around
the ring with ``batch_isend_irecv``, partial results merged by log-sum-exp, a backward ring of
its own, zigzag chunks for load balance. ``ulysses`` (:mod:`.ulysses`): all-to-all from
sequence-sharded to head-sharded and back. torch's own ``context_parallel`` intercepts only the
CUDA SDPA kernels, so on the CPU (gloo) plait exchanges keys and values itself; the attention of
each tile is ATen's fused CPU kernel (:mod:`.kernels`).

A model takes part by carrying ``context_parallel_plan`` (its plugin declares
``model:context_parallel``; :mod:`.apply`) and ``n_head`` (a model its plugin cannot plan says
why in ``no_context_parallel_plan_reason``); an engine by reducing gradients over
``dp x cp`` ranks (``engine:context_parallel``). Packed documents (``data.pack=true``) pass their
document ids to the attention, which never crosses a boundary. Context parallelism shards no
parameter: checkpoints are those of the same run without it. Each logged step reports the
logging rank's ``context_parallel/exchange_bytes`` and ``context_parallel/exchanges`` (what its
attention sent since the previous logged step). See ``docs/context_parallel.md``.
"""

from __future__ import annotations

from dataclasses import dataclass

from plait import hookimpl
from plait.config import ContextParallelConfig
from plait.meta import meta_model
from plait.plugins.context_parallel.apply import (
    BACKENDS,
    STYLES,
    SequenceShardLoss,
    apply_context_parallel,
    exchange_bytes,
    layout_for,
    planned,
)
from plait.plugins.context_parallel.ring import ExchangeStats
from plait.types import AxisCost, PluginInfo


@dataclass
class PlaitContextParallelConfig(ContextParallelConfig):
    name: str = "plait"
    backend: str = "ring"  # ring | ulysses


stats = ExchangeStats()  # this process's attention exchanges, for the logged metrics


@hookimpl
def plait_declare() -> PluginInfo:
    return PluginInfo(
        name="context_parallel",
        selected_by={"context_parallel.name": "plait"},
        requires={"cp": frozenset({"model:context_parallel", "engine:context_parallel"})},
        description="context parallelism: ring attention (zigzag) or Ulysses all-to-all",
    )


@hookimpl
def plait_register_configs(config_store) -> None:
    config_store.store(
        group="context_parallel", name="base_plait_cp", node=PlaitContextParallelConfig
    )


@hookimpl
def plait_validate(cfg, dims, hook) -> list[str]:
    backend, cp = cfg.context_parallel.backend, dims.cp
    if backend not in BACKENDS:
        return [f"context_parallel.backend={backend}: choose one of {', '.join(BACKENDS)}"]
    if cp == 1:
        return []
    problems, seq_len = [], cfg.train.seq_len
    chunks = 2 * cp if backend == "ring" else cp
    if seq_len % chunks:
        why = (
            "zigzag load balancing cuts each sequence into 2·cp chunks"
            if backend == "ring"
            else "each rank holds seq_len / cp tokens"
        )
        problems.append(
            f"train.seq_len={seq_len} is not divisible by {chunks} for "
            f"context_parallel.backend={backend} with parallel.cp={cp} ({why}): "
            f"choose train.seq_len as a multiple of {chunks}"
        )
    model = meta_model(hook, cfg)
    if model is None:  # the models plugin says why
        return problems
    plan = getattr(model, "context_parallel_plan", None)
    if plan is None:
        reason = getattr(model, "no_context_parallel_plan_reason", None)  # the model says why
        why = reason or (
            "the model carries no context_parallel_plan (which module takes the "
            "token ids, which is the attention core)"
        )
        return problems + [
            f"parallel.cp={cp}: plait cannot replace the attention of model._target_="
            f"{cfg.model._target_}: {why}; use a model that has one (plait's GPT: "
            "model=gpt_tiny, gpt2_small; model=hf with Llama-family attention) or parallel.cp=1"
        ]
    for style in STYLES:
        if not planned(model, plan, style):
            problems.append(
                f"parallel.cp={cp}: the context_parallel_plan of model._target_="
                f"{cfg.model._target_} names no {style!r} module that exists: fix "
                "the model's plan"
            )
    heads = getattr(model, "n_head", None)
    if backend == "ulysses" and heads is not None and (heads // dims.tp) % cp:
        # a setting of plait's GPT; model=hf reads it from config.json (num_attention_heads)
        name = "model.n_head" if "n_head" in cfg.model else "the model's n_head"
        per_rank = (
            f"{name} / parallel.tp = {heads // dims.tp}" if dims.tp > 1 else f"{name}={heads}"
        )
        problems.append(
            f"context_parallel.backend=ulysses with parallel.cp={cp}: the heads "
            f"({per_rank}) are not divisible by cp, and Ulysses gives each rank "
            f"heads / cp of them: choose parallel.cp dividing {heads // dims.tp}, "
            "or context_parallel.backend=ring"
        )
    return problems


@hookimpl
def plait_apply_context_parallel(cfg, model, topology) -> None:
    dims = topology.dims
    if dims.cp == 1:
        return
    backend = cfg.context_parallel.backend
    layout = layout_for(backend, cfg.train.seq_len, dims.cp, topology.cp_rank)
    replaced = apply_context_parallel(model, backend, layout, topology.group("cp"), stats)
    if topology.is_logging_rank:
        print(
            f"context parallelism ({backend}, cp={dims.cp}): {layout.local_len} of "
            f"{layout.seq_len} tokens per sequence on each rank, {len(replaced)} attention "
            "modules exchange keys and values",
            flush=True,
        )


@hookimpl(wrapper=True)
def plait_build_loss(cfg, model, topology):
    """The decided loss (or cross-entropy), on the targets of this rank's tokens."""
    loss_fn = yield
    if topology.dims.cp == 1:
        return loss_fn
    from plait.train import cross_entropy

    return SequenceShardLoss(
        loss_fn or cross_entropy,
        layout_for(
            cfg.context_parallel.backend, cfg.train.seq_len, topology.dims.cp, topology.cp_rank
        ),
    )


@hookimpl(tryfirst=True)
def plait_log_metrics(metrics) -> None:
    """Before the trackers see the step: what this rank's attention sent since the last one."""
    counts = stats.take()
    if counts["exchanges"]:
        metrics["context_parallel/exchanges"] = float(counts["exchanges"])
        metrics["context_parallel/exchange_bytes"] = float(counts["bytes_sent"])


@hookimpl
def plait_axis_cost(
    cfg, axis, model, dims, seq_len, micro_batch_size, microbatches, bytes_per_value
) -> AxisCost | None:
    """What context parallelism sends per step (``plait plan --search``): the attention
    exchange of ``context_parallel.backend`` per layer, forward and backward
    (:func:`~plait.plugins.context_parallel.apply.exchange_bytes`), over the layers of a
    stage and the step's micro-batches."""
    if axis != "cp" or cfg.context_parallel.name != "plait":
        return None
    h, n_layer = getattr(model, "n_embd", 0), getattr(model, "n_layer", 0)
    per_layer = exchange_bytes(
        cfg.context_parallel.backend,
        seq_len,
        micro_batch_size,
        h // dims.tp,
        dims.cp,
        bytes_per_value,
    )
    return AxisCost(per_layer * n_layer / dims.pp * microbatches)
