"""Model-state memory per rank: the ZeRO paper's formula, DeepSpeed's estimators, and a measurement.

With Ψ parameters, N data-parallel ranks, b_p / b_g bytes per parameter / gradient element and
K bytes of optimizer state per parameter (Rajbhandari et al. 2020, "ZeRO", section 5)::

    ddp / zero0:  (b_p + b_g + K) Ψ
    zero1:        (b_p + b_g) Ψ + K Ψ / N
    zero2:        b_p Ψ + (b_g + K) Ψ / N
    zero3:        (b_p + b_g + K) Ψ / N

b_p = b_g = 2 for bf16/fp16 and 4 for fp32. For Adam K = 8 (momentum and variance in fp32) plus
4 for an fp32 master copy of the parameters where one is kept: in bf16/fp16 (K = 12, the paper's
case); in fp32 the optimizer steps the parameters themselves (K = 8: stage 0 and DDP with torch
AdamW on the parameters, ZeRO-1/2/3 through ``fp32_master.py``). Offloaded states count as host
memory, not device memory.

Activations are the model's own count (``model.activation_bytes(batch_size, seq_len,
bytes_per_value)``, e.g. :meth:`plait.plugins.models.gpt.GPT.activation_bytes`), checked against
:func:`measure_activation_bytes`; a model without one gets no activation figure.

``measure_model_states`` counts what a running engine holds: the bytes of the storages behind the
parameters (ZeRO-3: this rank's partition), the gradients (``param.grad`` and ZeRO's reduced
gradient partitions) and the optimizer (master copy and states), each storage once. The engine
measures after the first micro-batch's backward of its second step: the moment parameters,
accumulating gradients and optimizer states all exist (with ``train.grad_accum_steps >= 2`` this
is mid-accumulation, where ZeRO-1 holds full gradients and ZeRO-2/3 only their partition).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

from plait.config import BYTES_PER_VALUE, runs_on_cpu
from plait.meta import parameters_per_rank
from plait.plugins.zero.config import STAGES
from plait.plugins.zero.sizing import working_memory_settings
from plait.types import StrategyCost


@dataclass(frozen=True)
class ModelStates:
    """Bytes per rank, split as the ZeRO paper splits them."""

    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def zero_formula(n_params: int, stage: int, dp: int, precision: str) -> ModelStates:
    """The paper's per-rank bytes for ZeRO ``stage`` (0 = DDP) with DeepSpeed's optimizer K."""
    b = BYTES_PER_VALUE[precision]
    k = 8 if precision == "fp32" else 12
    params = n_params * b / (dp if stage >= 3 else 1)
    grads = n_params * b / (dp if stage >= 2 else 1)
    optimizer = n_params * k / (dp if stage >= 1 else 1)
    return ModelStates(int(params), int(grads), int(optimizer))


def strategy_cost(cfg, strategy: str, model: torch.nn.Module, dims) -> StrategyCost:
    """``plait_strategy_cost`` for ``strategy=zero0..zero3``: the paper's model states on this
    rank's ``Ψ = N/(tp·pp)`` (experts: over ``ep`` too, and partitioned over ``dp/ep``),
    DeepSpeed's buffers as plait sizes them (``sizing.py``: a reduce and an all-gather bucket of
    ``B`` elements; ZeRO-3 see :func:`zero3_buffer_elements`), and per step a
    reduce-scatter/all-reduce of the gradients, plus under ZeRO-3 the parameters gathered in
    forward and in backward: ``(2 or 3)·(dp−1)/dp·Ψ·b``. With context parallelism ZeRO
    partitions over the ``dp x cp`` ranks: ``dp`` here is their number."""
    stage, b = STAGES[strategy], BYTES_PER_VALUE[cfg.precision]
    dense, experts = parameters_per_rank(model, dims)
    psi = dense + experts
    dp = dims.dp_cp
    states = zero_formula(dense, stage, dp, cfg.precision)
    if experts:  # partitioned over the ranks that hold the same experts (experts.py)
        more = zero_formula(experts, stage, dims.dp // dims.ep, cfg.precision)
        states = ModelStates(
            states.params + more.params,
            states.grads + more.grads,
            states.optimizer + more.optimizer,
        )
    bucket = working_memory_settings(model, stage, dims.tp * dims.pp).get("reduce_bucket_size", 0)
    own = cfg.strategy.name == strategy  # its offload settings are in cfg.strategy
    offloaded = frozenset(
        name
        for name, setting in (("optimizer", "offload_optimizer"), ("params", "offload_params"))
        if own and cfg.strategy[setting] != "none"
    )
    references = {}
    reference = own and deepspeed_estimate(
        psi,
        max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()),
        stage,
        dp,
        "optimizer" in offloaded,
        "params" in offloaded,
    )
    if reference:
        references["DeepSpeed's estimator (device, assumes 16-bit training)"] = reference
    return StrategyCost(
        params=states.params,
        grads=states.grads,
        optimizer=states.optimizer,
        buffers=bucket * b * (zero3_buffer_elements(cfg) if stage == 3 else 2),
        dp_bytes_per_step=(3 if stage == 3 else 2) * (dp - 1) / dp * psi * b,
        offloaded=offloaded,
        references=references,
    )


def zero3_buffer_elements(cfg) -> int:
    """ZeRO-3's working buffers in units of the bucket ``B``, read from DeepSpeed 0.19's stage 3
    and a memory profile of its backward on gloo: up to ``2B`` gathered parameters
    (``stage3_max_live_parameters``), the reduce bucket ``B``, and its reduce-scatter
    (``reduce_scatter_coalesced``) which concatenates the bucket's padded partitions into a flat
    copy ``B``; gloo's ``reduce_scatter_tensor`` copies its input once more (``B``, CPU only)."""
    return 4 + (1 if runs_on_cpu(cfg) else 0)


def deepspeed_estimate(
    n_params: int,
    largest_layer_params: int,
    stage: int,
    dp: int,
    offload_optimizer: bool,
    offload_params: bool,
) -> int | None:
    """Device bytes per rank from DeepSpeed's own estimator (stages 2 and 3 only; it assumes
    16-bit training)."""
    if stage == 2:
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

        _, device = estimate_zero2_model_states_mem_needs(
            n_params, num_gpus_per_node=dp, num_nodes=1, cpu_offload=offload_optimizer
        )
        return device
    if stage == 3:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

        _, device, _ = estimate_zero3_model_states_mem_needs(
            n_params,
            largest_layer_params,
            num_gpus_per_node=dp,
            num_nodes=1,
            cpu_offload=offload_optimizer,
            cpu_offload_params=offload_params,
        )
        return device
    return None


# ---------------------------------------------------------------------------------------------
# measurement in a running engine
# ---------------------------------------------------------------------------------------------


def _unique_bytes(tensors: Iterable[torch.Tensor | None], seen: set[int]) -> int:
    """Bytes of the storages behind ``tensors`` not counted before (views of one flat buffer
    count the buffer once, as ZeRO's flat partitions are allocated)."""
    total = 0
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor) or t.device.type == "meta":
            continue
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if storage.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def _grad_buffers(zero_optimizer) -> list[torch.Tensor]:
    """Where DeepSpeed's ZeRO optimizers keep reduced gradients besides ``param.grad``."""
    tensors = []
    contiguous = getattr(zero_optimizer, "grads_in_partition", None)  # stage 2, flat partition
    if isinstance(contiguous, torch.Tensor):
        tensors.append(contiguous)
    for name in ("averaged_gradients", "all_grad_tensors"):  # stage 1/2, per param group
        by_group = getattr(zero_optimizer, name, None)
        if isinstance(by_group, dict):
            for grads in by_group.values():
                tensors += [g for g in grads or [] if isinstance(g, torch.Tensor)]
    flat = getattr(zero_optimizer, "grad_partitions_flat_buffer", None)  # stage 3
    if isinstance(flat, torch.Tensor):
        tensors.append(flat)
    return tensors


def measure_model_states(
    module: torch.nn.Module, optimizer: torch.optim.Optimizer, zero_optimizer=None
) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer states this rank holds right now.

    ``optimizer`` is the torch optimizer that steps (inside DeepSpeed: the one its ZeRO optimizer
    wraps, stepping the master partitions); ``zero_optimizer`` is DeepSpeed's wrapper, whose
    reduced-gradient buffers count as gradients. Call it after a backward of a step that follows
    at least one optimizer step, so that the optimizer states exist.
    """
    seen: set[int] = set()
    local_params = [getattr(p, "ds_tensor", p) for p in module.parameters()]
    params = _unique_bytes(local_params, seen)
    steps = [p for g in optimizer.param_groups for p in g["params"]]
    buffers = _grad_buffers(zero_optimizer) if zero_optimizer is not None else []
    grads = _unique_bytes(
        [p.grad for p in module.parameters()] + buffers + [p.grad for p in steps], seen
    )
    states = [
        t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)
    ]
    optimizer_bytes = _unique_bytes(steps + states, seen)
    return {"params": params, "grads": grads, "optimizer": optimizer_bytes}


def measure_activation_bytes(
    model: torch.nn.Module, loss_fn, inputs: torch.Tensor, targets: torch.Tensor
) -> int:
    """Bytes autograd saves for backward in one forward and loss of ``model`` (weights and
    their views excluded, each storage once): what a model's ``activation_bytes`` estimates."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss_fn(model(inputs), targets)
    return sum(saved.values())


def measure_deepspeed_engine(ds_engine) -> dict[str, int]:
    zero_optimizer = ds_engine.optimizer
    inner = getattr(zero_optimizer, "optimizer", zero_optimizer)  # the torch optimizer
    return measure_model_states(ds_engine.module, inner, zero_optimizer)
