"""``parallel.tp=N`` (``tensor_parallel=megatron``, the default): Megatron-style tensor
parallelism, and with ``tensor_parallel.sequence_parallel=true`` Megatron's sequence parallelism.

Every rank builds the full seeded model; :func:`plait_apply_tensor_parallel` then replaces the
modules the plan names by column-/row-/vocab-parallel layers holding slices of the full weights,
so the split model starts exactly where the single-device model does. The plan is the model's own
``tensor_parallel_plan`` (a model plugin declares ``model:tensor_parallel_plan``) or
``tensor_parallel.plan``. With ``parallel.tp=1`` nothing happens. See
``docs/tensor_parallel.md``.

    plait train parallel.tp=2 launcher.nproc_per_node=2
    plait train parallel.tp=2 tensor_parallel.sequence_parallel=true launcher.nproc_per_node=4
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from plait import hookimpl
from plait.config import TensorParallelConfig
from plait.meta import meta_model
from plait.plugins.tensor_parallel.plan import apply_plan, merge_shards, plan_for, plan_problems
from plait.types import AxisCost, PluginInfo


@dataclass
class MegatronConfig(TensorParallelConfig):
    name: str = "megatron"
    sequence_parallel: bool = False
    # None: the model's own tensor_parallel_plan; or {module-name pattern:
    # colwise|colwise_qkv|rowwise|vocab|norm|sequence_scatter|replicate}
    plan: Any = None


@hookimpl
def plait_declare() -> PluginInfo:
    return PluginInfo(
        name="tensor_parallel",
        selected_by={"tensor_parallel.name": "megatron"},
        requires={"tp": frozenset({"engine:tensor_parallel", "model:tensor_parallel_plan"})},
        description="Megatron-style tensor and sequence parallelism",
    )


@hookimpl
def plait_register_configs(config_store) -> None:
    config_store.store(group="tensor_parallel", name="base_megatron", node=MegatronConfig)


@hookimpl
def plait_validate(cfg, dims, hook) -> list[str]:
    settings = cfg.tensor_parallel
    if dims.tp == 1:
        if settings.sequence_parallel:
            return [
                "tensor_parallel.sequence_parallel=true needs tensor parallelism: set "
                "parallel.tp to 2 or more, or tensor_parallel.sequence_parallel=false"
            ]
        return []
    model = meta_model(hook, cfg)
    if model is None:  # the models plugin says why
        return []
    problems = plan_problems(cfg, model)
    if problems or not settings.sequence_parallel:
        return problems
    plan = plan_for(cfg, model)
    if plan is not None and not plan.supports_sequence_parallel:
        problems.append(
            f"tensor_parallel.sequence_parallel=true: the tensor-parallel plan of "
            f"model._target_={cfg.model._target_} has no 'sequence_scatter' entry "
            "(the module whose output enters the sequence-parallel region): add one "
            "in tensor_parallel.plan or set tensor_parallel.sequence_parallel=false"
        )
    if cfg.train.seq_len % (dims.tp * dims.cp):
        held = (
            f"the {cfg.train.seq_len // dims.cp} tokens each context-parallel rank holds "
            f"(train.seq_len={cfg.train.seq_len} / parallel.cp={dims.cp})"
            if dims.cp > 1
            else f"train.seq_len={cfg.train.seq_len}"
        )
        problems.append(
            f"tensor_parallel.sequence_parallel=true: parallel.tp={dims.tp} does not "
            f"divide {held}: choose seq_len as a multiple of "
            f"{dims.tp * dims.cp}"
        )
    return problems


@hookimpl
def plait_apply_tensor_parallel(cfg, model, topology) -> None:
    if topology.dims.tp == 1:
        return
    apply_plan(
        model,
        plan_for(cfg, model),
        topology.group("tp"),
        topology.tp_rank,
        topology.dims.tp,
        cfg.tensor_parallel.sequence_parallel,
    )


@hookimpl(wrapper=True)
def plait_build_engine(cfg, topology, hook):
    """Before the first step, the shards are checked against the model's own forward on its
    stand-in (:mod:`.fidelity`; raises when they differ). After the build, so that the first
    computation's one-off memory (torch's CPU kernels, about 20 MB) lands where the first step
    would pay it, not in the peak of reading this rank's part."""
    engine = yield
    if topology.dims.tp > 1:
        from plait.plugins.tensor_parallel.fidelity import check_shard_composition

        model = meta_model(hook, cfg)  # the unsplit model's plan and stand-in
        if model is not None:
            check_shard_composition(cfg, model, plan_for(cfg, model), topology)
    return engine


@hookimpl
def plait_build_loss(cfg, model, topology):
    if topology.dims.tp == 1:
        return None
    if not any(getattr(m, "is_vocab_parallel_output", False) for m in model.modules()):
        return None
    from plait.plugins.tensor_parallel.layers import VocabParallelCrossEntropy

    return VocabParallelCrossEntropy(topology.group("tp"), topology.tp_rank)


@hookimpl
def plait_merge_tensor_parallel_shards(cfg, shards, model) -> dict | None:
    if len(shards) == 1:
        return None
    return merge_shards(plan_for(cfg, model), shards)


@hookimpl
def plait_axis_cost(
    cfg, axis, model, dims, seq_len, micro_batch_size, microbatches, bytes_per_value, recompute
) -> AxisCost | None:
    """What tensor parallelism sends per step (``plait plan --search``): ``k`` all-reduces of a
    rank's activations per layer, 2 in forward and 2 in backward (6 when full recompute repeats
    the forward's), each ``2(tp-1)/tp`` of ``s/cp·b·h·v`` bytes; 0 without the model's ``h`` and
    ``L`` (``n_embd``, ``n_layer``)."""
    if axis != "tp" or cfg.tensor_parallel.name != "megatron":
        return None
    tp, h = dims.tp, getattr(model, "n_embd", 0)
    activation_msg = seq_len // dims.cp * micro_batch_size * h * bytes_per_value
    all_reduces = 6 if recompute == "full" else 4
    return AxisCost(
        all_reduces
        * 2
        * (tp - 1)
        / tp
        * activation_msg
        * getattr(model, "n_layer", 0)
        / dims.pp
        * microbatches
    )
