"""``parallel.ep=E`` (``expert_parallel=alltoall``, the default): expert parallelism for
mixture-of-experts models, and the MoE bookkeeping of every run with experts.

    plait train model.n_experts=8 model.top_k=2 parallel.ep=4 launcher.nproc_per_node=4
    plait train model.n_experts=8 parallel.ep=2 parallel.tp=2 launcher.nproc_per_node=4

The experts of each MoE layer are spread over the ``ep`` ranks of an expert-parallel group,
carved out of the data-parallel ranks (``plait.topology``: ``dp = edp x ep``): rank ``r`` of the
group keeps experts ``[r·E/ep, (r+1)·E/ep)`` under their global names, and tokens go to them and
back through ``all_to_all_single`` (``dispatch.py``). Expert parameters are averaged over the
expert-data-parallel group (``grads.py``), by the strategy's engine, which declares
``engine:expert_parallel``: DDP and the pipeline engine, DeepSpeed ZeRO-0..2 (expert and dense
parameters in separate ZeRO groups, DeepSpeed-MoE's ``moe`` param groups over its expert data
parallel groups). The model declares ``model:experts``: its MoE layers follow the contract of
:class:`plait.plugins.models.moe.MoE` (``is_moe_layer``, ``experts`` keyed by global index, a
replaceable ``dispatcher``, ``stats``, ``aux_loss_scale``).

At every ``ep`` (1 included) the engine is wrapped (``engine.py``) to scale the routers'
auxiliary losses like the micro-batches' loss and to log tokens per expert, dropped tokens, the
auxiliary losses and the all-to-all's time and bytes. Checkpoints need nothing: experts keep
their global names, so the layout-free copy holds every expert once, whatever ``ep`` wrote it.
"""

from __future__ import annotations

from dataclasses import dataclass

from plait import hookimpl
from plait.config import ExpertParallelConfig
from plait.types import AxisCost, PluginInfo


@dataclass
class AllToAllConfig(ExpertParallelConfig):
    name: str = "alltoall"


def moe_layers(model) -> list:
    """The model's mixture-of-experts layers (modules with ``is_moe_layer``), in model order."""
    return [m for m in model.modules() if getattr(m, "is_moe_layer", False)]


@hookimpl
def plait_declare() -> PluginInfo:
    return PluginInfo(
        name="expert_parallel",
        selected_by={"expert_parallel.name": "alltoall"},
        requires={"ep": frozenset({"engine:expert_parallel", "model:experts"})},
        description="expert parallelism (all-to-all token dispatch), MoE metrics",
    )


@hookimpl
def plait_register_configs(config_store) -> None:
    config_store.store(group="expert_parallel", name="base_alltoall", node=AllToAllConfig)


@hookimpl
def plait_backend_config(cfg, dims) -> dict:
    """``plait plan`` shows the expert-parallel and expert-data-parallel groups."""
    if dims.ep == 1:
        return {}
    from plait.topology import expert_groups

    ep_groups, edp_groups = expert_groups(dims)
    return {
        "expert parallelism (parallel.ep)": {
            "experts per rank": f"model.n_experts / {dims.ep}",
            "ep groups (exchange tokens)": [str(g) for g in ep_groups[:8]],
            "edp groups (average expert gradients)": [str(g) for g in edp_groups[:8]],
        }
    }


@hookimpl
def plait_apply_expert_parallel(cfg, model, topology) -> None:
    """Number the MoE layers (rows of the metrics); with ``ep > 1`` keep this rank's experts,
    mark them, and give each layer an all-to-all dispatcher."""
    layers = moe_layers(model)
    for row, layer in enumerate(layers):
        layer.stats_row, layer.stats_rows = row, len(layers)
    dims = topology.dims
    if dims.ep == 1 or not layers:
        return
    from plait.engine.experts import mark_expert
    from plait.plugins.expert_parallel.dispatch import AllToAllDispatcher, AllToAllMeter

    meter = AllToAllMeter()
    for layer in layers:
        dispatcher = AllToAllDispatcher(
            topology.group("ep"), dims.ep, topology.ep_rank, layer.n_experts, meter
        )
        mine = {str(dispatcher.first + j) for j in range(dispatcher.local)}
        for key in [k for k in layer.experts.keys() if k not in mine]:
            del layer.experts[key]
        for p in layer.experts.parameters():
            mark_expert(p, dims.ep)
        layer.dispatcher = dispatcher


@hookimpl(wrapper=True, tryfirst=True)  # outermost: around a pipeline's engine too
def plait_build_engine(cfg, model, topology):
    engine = yield
    layers = moe_layers(model)
    if not layers:
        return engine
    from plait.config import job_last_step
    from plait.plugins.expert_parallel.engine import MoEEngine

    every, last = cfg.train.log_every, job_last_step(cfg.train)
    meter = next((getattr(layer.dispatcher, "meter", None) for layer in layers), None)
    return MoEEngine(
        engine, layers, topology, meter, logged=lambda step: step % every == 0 or step == last
    )


@hookimpl(wrapper=True)
def plait_load_checkpoint(engine):
    """A resumed engine counts its steps on from the checkpoint's (which steps are logged)."""
    state = yield
    if state is not None and hasattr(engine, "logged"):
        engine.step = state.step
    return state


@hookimpl
def plait_axis_cost(
    cfg, axis, model, dims, seq_len, micro_batch_size, microbatches, bytes_per_value
) -> AxisCost | None:
    """What expert parallelism sends per step (``plait plan --search``): a mixture of experts'
    all-to-all, tokens out and back in forward and their gradients in backward, ``4(ep-1)/ep``
    of ``k·s/cp·b·h·v`` bytes per MoE layer of a stage (``k`` = top_k choices per token)."""
    if axis != "ep" or cfg.expert_parallel.name != "alltoall":
        return None
    moe = [layer for layer in model.modules() if getattr(layer, "is_moe_layer", False)]
    if not moe:
        return AxisCost(0.0)
    ep = dims.ep
    activation_msg = (
        seq_len // dims.cp * micro_batch_size * getattr(model, "n_embd", 0) * bytes_per_value
    )
    return AxisCost(
        4 * (ep - 1) / ep * moe[0].top_k * activation_msg * len(moe) / dims.pp * microbatches
    )
