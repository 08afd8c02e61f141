"""``plait estimate [overrides]``: per-rank memory of a planned run, without starting it.

Prints what the chosen strategy's plugin estimates for one rank (``plait_strategy_cost``): bytes
of parameters, gradients and optimizer states (for DDP and ZeRO the ZeRO paper's formula), the
engine's buffers, other estimators' figures where the plugin has them (DeepSpeed's own), and the
model's own count of one micro-batch's activations, for the model, strategy, world size and
precision the overrides give. The model is built on the ``meta`` device, so even a large model
costs no memory. A strategy whose plugin does not answer is refused, naming the ones that do.
"""

from __future__ import annotations

import torch

from plait.config import BYTES_PER_VALUE
from plait.meta import meta_model, parameters_per_rank
from plait.plan import make_plan
from plait.types import StrategyCost


def gib(n: float) -> str:
    value, unit = (n / 2**30, "GiB") if n >= 2**30 else (n / 2**20, "MiB")
    return f"{value:10.3f} {unit}  ({int(n):,} B)"


def estimated_strategies(pm, cfg, model: torch.nn.Module, dims) -> list[str]:
    """Every ``strategy.name`` an installed plugin is selected by and estimates
    (``plait_strategy_cost``): what the planner searches."""
    names = []
    for record in pm.records.values():
        selected = record.info.selected_by.get("strategy.name", ())
        for name in (selected,) if isinstance(selected, str) else selected:
            if (
                name not in names
                and pm.hook.plait_strategy_cost(cfg=cfg, strategy=name, model=model, dims=dims)
                is not None
            ):
                names.append(name)
    return names


def strategy_cost(plan, model: torch.nn.Module) -> StrategyCost:
    cfg = plan.cfg
    found = plan.pm.hook.plait_strategy_cost(
        cfg=cfg, strategy=cfg.strategy.name, model=model, dims=plan.dims
    )
    if found is None:
        from plait.plugin_manager import make_plugin_manager

        known = estimated_strategies(make_plugin_manager(), cfg, model, plan.dims)
        raise ValueError(
            f"strategy={cfg.strategy.name}: its plugin gives no estimate "
            f"(plait_strategy_cost); plait estimate knows {', '.join(known)}"
        )
    return found


def activation_bytes(plan, model: torch.nn.Module, micro_batch_size: int) -> int | None:
    """The model's own count of one micro-batch's activations (None if it has none), divided
    by tp: tensor parallelism splits all of them but the LayerNorm inputs (approximate), and by
    cp: context parallelism keeps ``seq_len/cp`` tokens of each. Under activation
    checkpointing the model is asked with ``recompute=<mode>``."""
    count = getattr(model, "activation_bytes", None)
    if not callable(count):
        return None
    cfg = plan.cfg
    mode = cfg.train.activation_checkpointing
    recompute = {} if mode == "none" else {"recompute": mode}
    return (
        count(micro_batch_size, cfg.train.seq_len, BYTES_PER_VALUE[cfg.precision], **recompute)
        // plan.dims.tp
        // plan.dims.cp
    )


def estimate_lines(plan) -> list[str]:
    cfg, dims = plan.cfg, plan.dims
    model = meta_model(plan.pm.hook, cfg)
    n_params = sum(p.numel() for p in model.parameters())  # a tied weight is listed once
    per_rank_params = sum(parameters_per_rank(model, dims))  # tp/pp (and ep) split the weights
    est = strategy_cost(plan, model)
    micro = cfg.train.batch_size // (cfg.train.grad_accum_steps * dims.dp)
    activations = activation_bytes(plan, model, micro)

    def host(part: str) -> str:
        return "  [offloaded to host]" if part in est.offloaded else ""

    lines = [
        f"model: {n_params:,} parameters ({per_rank_params:,} per rank after "
        f"tp={dims.tp} x pp={dims.pp}"
        + (f" x ep={dims.ep}" if dims.ep > 1 else "")
        + f"); strategy={cfg.strategy.name} dp={dims.dp} "
        + (f"cp={dims.cp} " if dims.cp > 1 else "")
        + f"precision={cfg.precision}",
        "model states per rank (the strategy's estimate; DDP and ZeRO: the ZeRO paper's formula):",
        f"  parameters      {gib(est.params)}{host('params')}",
        f"  gradients       {gib(est.grads)}",
        f"  optimizer       {gib(est.optimizer)}{host('optimizer')}",
        f"  total           {gib(est.states)}",
        f"engine buffers    {gib(est.buffers)}",
    ]
    for name, value in est.references.items():
        lines.append(f"  {name}: {gib(value)}")
    if activations is not None:
        lines.append(
            f"activations per micro-batch of {micro} (estimate, activation "
            f"checkpointing {cfg.train.activation_checkpointing}): {gib(activations)}"
        )
        lines.append(f"total per rank on the device   {gib(est.device_bytes + activations)}")
    else:
        lines.append(
            "activations: unknown (the model has no activation_bytes(batch_size, "
            "seq_len, bytes_per_value) method)"
        )
    return lines


def cmd_estimate(overrides: list[str]) -> int:
    plan = make_plan(overrides).check()
    print("\n".join(estimate_lines(plan)))
    return 0
