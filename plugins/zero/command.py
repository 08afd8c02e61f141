"""``plait estimate [overrides]``: per-rank memory of a planned run, without starting it.

Prints bytes of parameters, gradients and optimizer states per rank (the ZeRO paper's formula,
:mod:`plait.plugins.zero.estimate`), DeepSpeed's own estimate where DeepSpeed has one, and the
activations of one micro-batch, for the model, strategy, world size and precision the overrides
give. The model is built on the ``meta`` device, so even a large model costs no memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from plait.meta import meta_model
from plait.plan import make_plan
from plait.plugins.zero import config as zero_config
from plait.plugins.zero.estimate import (
    BYTES,
    ModelStates,
    ddp_formula,
    deepspeed_estimate,
    zero_formula,
)


def gib(n: float) -> str:
    value, unit = (n / 2**30, "GiB") if n >= 2**30 else (n / 2**20, "MiB")
    return f"{value:10.3f} {unit}  ({int(n):,} B)"


def count_params(model: torch.nn.Module) -> tuple[int, int]:
    """Total parameters and the largest module's own parameters (DeepSpeed's "largest layer")."""
    total = sum(p.numel() for p in model.parameters())  # a tied weight is listed once
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    return total, largest


@dataclass
class Estimate:
    n_params: int
    per_rank_params: int
    states: ModelStates
    deepspeed_bytes: int | None  # DeepSpeed's own estimator, where it has one
    offload_optimizer: bool = False
    offload_params: bool = False


def model_states(strategy: str, per_rank_params: int, dp: int, precision: str) -> ModelStates:
    """The paper's per-rank bytes for ``strategy=ddp|zero0..zero3`` (offload not counted)."""
    if strategy == "ddp":
        return ddp_formula(per_rank_params)
    if strategy not in zero_config.STAGES:
        raise ValueError(f"strategy={strategy}: plait estimate knows ddp and zero0..zero3")
    return zero_formula(per_rank_params, zero_config.STAGES[strategy], dp, precision)


def estimate_model_states(plan) -> Estimate:
    """Per-rank model-state bytes for the planned model, strategy, dp size and precision."""
    cfg, dims = plan.cfg, plan.dims
    strategy = cfg.strategy.name
    n_params, largest = count_params(meta_model(plan.pm.hook, plan.cfg))
    per_rank_params = n_params // (dims.tp * dims.pp)  # tp/pp split the weights (approximately)
    states = model_states(strategy, per_rank_params, dims.dp, cfg.precision)
    if strategy == "ddp":
        return Estimate(n_params, per_rank_params, states, None)
    stage = zero_config.stage_of(cfg)
    offload_opt = cfg.strategy.offload_optimizer != "none"
    offload_params = cfg.strategy.offload_params != "none"
    return Estimate(n_params, per_rank_params, states,
                    deepspeed_estimate(per_rank_params, largest, stage, dims.dp, offload_opt,
                                       offload_params),
                    offload_opt, offload_params)


def activation_bytes(plan, micro_batch_size: int) -> int | None:
    """The model's own count of one micro-batch's activations (None if it has none), divided
    by tp: tensor parallelism splits all of them but the LayerNorm inputs (approximate).
    Under activation checkpointing the model is asked with ``recompute=<mode>``."""
    count = getattr(meta_model(plan.pm.hook, plan.cfg), "activation_bytes", None)
    if not callable(count):
        return None
    cfg = plan.cfg
    mode = cfg.train.activation_checkpointing
    recompute = {} if mode == "none" else {"recompute": mode}
    return count(micro_batch_size, cfg.train.seq_len, BYTES[cfg.precision],
                 **recompute) // plan.dims.tp


def estimate_lines(plan) -> list[str]:
    cfg, dims = plan.cfg, plan.dims
    est = estimate_model_states(plan)
    states, ds = est.states, est.deepspeed_bytes
    offload_opt, offload_params = est.offload_optimizer, est.offload_params
    micro = zero_config.micro_batch_size(cfg, dims.dp)
    activations = activation_bytes(plan, micro)
    device_bytes = ((0 if offload_params else states.params) + states.grads
                    + (0 if offload_opt else states.optimizer))
    lines = [
        f"model: {est.n_params:,} parameters ({est.per_rank_params:,} per rank after "
        f"tp={dims.tp} x pp={dims.pp}); strategy={cfg.strategy.name} dp={dims.dp} "
        f"precision={cfg.precision}",
        "model states per rank (ZeRO paper's formula):",
        f"  parameters      {gib(states.params)}{'  [offloaded to host]' if offload_params else ''}",
        f"  gradients       {gib(states.grads)}",
        f"  optimizer       {gib(states.optimizer)}{'  [offloaded to host]' if offload_opt else ''}",
        f"  total           {gib(states.total)}",
    ]
    if ds is not None:
        lines.append(f"  DeepSpeed's estimator (device, assumes 16-bit training): {gib(ds)}")
    if activations is not None:
        lines.append(f"activations per micro-batch of {micro} (estimate, activation "
                     f"checkpointing {cfg.train.activation_checkpointing}): {gib(activations)}")
        lines.append(f"total per rank on the device   {gib(device_bytes + activations)}")
    else:
        lines.append("activations: unknown (the model has no activation_bytes(batch_size, "
                     "seq_len, bytes_per_value) method)")
    return lines


def cmd_estimate(overrides: list[str]) -> int:
    plan = make_plan(overrides).check()
    print("\n".join(estimate_lines(plan)))
    return 0
