"""``parallel.tp=N`` (``parallel.tensor=megatron``, the default): Megatron-style tensor
parallelism, and with ``parallel.sequence_parallel=true`` Megatron's sequence parallelism.

Every rank builds the full seeded model; :func:`plait_apply_tensor_parallel` then replaces the
modules the plan names by column-/row-/vocab-parallel layers holding slices of the full weights,
so the split model starts exactly where the single-device model does. The plan is the built-in
one for ``model._target_`` (plait's GPT, the ``transformers`` Llama) or ``parallel.tp_plan``.
With ``parallel.tp=1`` nothing happens. See ``docs/tensor_parallel.md``.

    plait train parallel.tp=2 launcher.nproc_per_node=2
    plait train parallel.tp=2 parallel.sequence_parallel=true launcher.nproc_per_node=4  # dp=2
"""

from __future__ import annotations

from plait import hookimpl
from plait.plugins.tensor_parallel.plan import apply_plan, merge_shards, plan_for, plan_problems
from plait.types import PluginInfo


@hookimpl
def plait_declare() -> PluginInfo:
    return PluginInfo(name="tensor_parallel", selected_by={"parallel.tensor": "megatron"},
                      description="Megatron-style tensor and sequence parallelism")


@hookimpl
def plait_validate(cfg, dims) -> list[str]:
    parallel = cfg.parallel
    if dims.tp == 1:
        if parallel.sequence_parallel:
            return ["parallel.sequence_parallel=true needs tensor parallelism: set parallel.tp "
                    "to 2 or more, or parallel.sequence_parallel=false"]
        return []
    problems = plan_problems(cfg, dims.tp)
    if cfg.precision == "fp16" and cfg.strategy.name == "ddp":
        problems.append(f"precision=fp16 with parallel.tp={dims.tp} and strategy=ddp: the loss "
                        "scaler checks overflow per rank, so tensor-parallel ranks could skip "
                        "different steps; use precision=bf16 or fp32")
    if problems or not parallel.sequence_parallel:
        return problems
    if not plan_for(cfg).supports_sequence_parallel:
        problems.append(f"parallel.sequence_parallel=true: the tensor-parallel plan for "
                        f"model._target_={cfg.model._target_} has no 'sequence_scatter' entry "
                        "(sequence parallelism is built in for plait's GPT only): set "
                        "parallel.sequence_parallel=false")
    if cfg.train.seq_len % dims.tp:
        problems.append(f"parallel.sequence_parallel=true: parallel.tp={dims.tp} does not divide "
                        f"train.seq_len={cfg.train.seq_len}: choose seq_len as a multiple of tp")
    return problems


@hookimpl
def plait_apply_tensor_parallel(cfg, model, topology) -> None:
    if topology.dims.tp == 1:
        return
    apply_plan(model, plan_for(cfg), topology.get_tensor_model_parallel_group(),
               topology.tp_rank, topology.dims.tp, cfg.parallel.sequence_parallel)


@hookimpl
def plait_build_loss(cfg, model, topology):
    if topology.dims.tp == 1:
        return None
    if not any(getattr(m, "is_vocab_parallel_output", False) for m in model.modules()):
        return None
    from plait.plugins.tensor_parallel.layers import VocabParallelCrossEntropy

    return VocabParallelCrossEntropy(topology.get_tensor_model_parallel_group(), topology.tp_rank)


@hookimpl
def plait_merge_tensor_parallel_shards(cfg, shards) -> dict | None:
    if len(shards) == 1:
        return None
    return merge_shards(plan_for(cfg), shards)
