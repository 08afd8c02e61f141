"""The planner's cost model: memory per rank and time per optimizer step of one layout.

Notation (Megatron's): ``N`` parameters, ``L`` layers, hidden size ``h``, sequence length ``s``,
global batch ``B`` sequences, micro-batch ``b``, ``m = B / (dp·b)`` micro-batches per step
(gradient-accumulation steps; under ``pp > 1`` the pipeline's micro-batches), ``v`` bytes per
activation value (the precision's), peak ``F`` FLOP/s of one device, bandwidth ``W`` bytes/s per
rank.

Memory per rank::

    states       = what the strategy's plugin estimates for one rank (plait_strategy_cost):
                   model states and the engine's buffers on the device (ddp, zero0-3: the
                   ZeRO paper's formula on Ψ = N / (tp·pp) parameters, ddp keeping fp32
                   parameters and gradients; sharded over dp·cp ranks)
    activations  = A(b, s, v, recompute) / tp / pp / cp · in_flight
    in_flight    = 1 without pipeline; with it, what the pipeline plugin says
                   (plait_axis_cost: min(m, pp) under 1F1B, the first stage holding pp
                   micro-batches; m under GPipe)

``A`` is the model's own ``activation_bytes(b, s, v, recompute=mode)`` for the whole model (what
``plait estimate`` prints); ``/tp`` as ``plait estimate`` divides it, ``/pp`` for the stage's
share of the layers, ``/cp`` for the rank's share of the tokens (context parallelism keeps
``s/cp`` tokens of every activation; the other ranks' keys and values pass through).

Time per step (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
Clusters", sec. 2-3)::

    compute  = (f(s) + r) · B · s / (dp·cp·tp·pp) / F
    bubble   = compute · (pp − 1) / m          (bubble fraction of the step: (pp−1)/(m+pp−1))
    comm     = bytes / W
    step     = compute + bubble + comm         (no overlap of communication with compute)

``f(s)`` is the model's ``flops_per_token(s)`` (6·N plus attention; 6·N for a model without
one). ``r`` is the recompute per token: one more forward, ``f(s)/3``, under ``full``; the
attention core's forward, ``(f(s) − f(0))/3``, under ``selective``. Bytes each rank sends per
step, with ring collectives (an all-reduce of ``M`` bytes over ``n`` ranks sends ``2(n−1)/n·M``,
a reduce-scatter or all-gather ``(n−1)/n·M``); the data-parallel term is the strategy plugin's
(``StrategyCost.dp_bytes_per_step``), with ``g`` bytes per gradient element (4 under ddp, whose
parameters stay fp32; ``v`` under ZeRO), and each other axis's term its own plugin's
(``plait_axis_cost``, asked for each axis larger than 1; the built-in plugins' formulas)::

    dp, ddp / zero0-2:  2(dp−1)/dp · Ψ · g     (all-reduce; ZeRO-2: reduce-scatter + all-gather)
    dp, zero3:          3(dp−1)/dp · Ψ · g     (parameters gathered in forward and backward)
    tp:  k · 2(tp−1)/tp · s/cp·b·h·v · L/pp · m (k = 4 all-reduces per layer, 2 forward and 2
                                               backward; 6 when full recompute repeats the
                                               forward's)
    pp:  2 · s/cp·b·h·v · m                    (activations forward, gradients backward)
    cp:  X(s, b, h/tp, cp) · L/pp · m          (the attention exchange per layer, forward and
                                               backward: ``context_parallel.backend``'s formula,
                                               the context-parallel plugin's exchange_bytes)
    ep:  4 · (ep−1)/ep · k·s·b·h·v · L_moe/pp · m   (a mixture of experts' all-to-all: tokens
                                               out and back in forward, their gradients in
                                               backward; k = top_k choices per token)

Without ``h`` and ``L`` on the model (``n_embd``, ``n_layer``) the tp and pp terms are 0. The
figures rank layouts; ``plait plan --search ... --confirm K`` runs the top K and prints what they
really take.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from plait.config import BYTES_PER_VALUE
from plait.metrics import flops_per_token
from plait.topology import ParallelDims
from plait.types import AxisCost, StrategyCost

AXES = ("tp", "pp", "cp", "ep")  # the axes other than dp, each estimated by its own plugin


@dataclass(frozen=True)
class Layout:
    """One candidate: the settings a run of it gets."""

    strategy: str
    dp: int
    tp: int
    pp: int
    micro_batch_size: int
    microbatches: int  # per optimizer step: train.grad_accum_steps (and pipeline.microbatches)
    activation_checkpointing: str
    cp: int = 1
    ep: int = 1  # expert parallelism, within dp (a model with experts)

    def describe(self) -> str:
        cp = f" cp{self.cp}" if self.cp > 1 else ""
        experts = f" ep{self.ep}" if self.ep > 1 else ""
        return (
            f"{self.strategy} dp{self.dp}{cp} tp{self.tp} pp{self.pp}{experts} micro "
            f"{self.micro_batch_size}x{self.microbatches} recompute "
            f"{self.activation_checkpointing}"
        )

    def overrides(self) -> list[str]:
        settings = [
            f"strategy={self.strategy}",
            f"parallel.dp={self.dp}",
            f"parallel.cp={self.cp}",
            f"parallel.tp={self.tp}",
            f"parallel.pp={self.pp}",
            f"parallel.ep={self.ep}",
            f"train.grad_accum_steps={self.microbatches}",
            f"train.activation_checkpointing={self.activation_checkpointing}",
        ]
        if self.pp > 1:
            settings.append(f"pipeline.microbatches={self.microbatches}")
        return settings


@dataclass(frozen=True)
class Cost:
    memory_bytes: int
    compute_s: float
    bubble_s: float
    comm_s: float

    @property
    def step_s(self) -> float:
        return self.compute_s + self.bubble_s + self.comm_s


@dataclass(frozen=True)
class Workload:
    """What is fixed across layouts: the model (on the meta device), batch, precision, hardware."""

    model: torch.nn.Module
    batch_size: int
    seq_len: int
    precision: str
    peak_flops: float
    bandwidth: float  # bytes/s per rank
    # (strategy, dp, tp, pp, cp, ep) -> what the strategy's plugin estimates for one rank
    strategy_cost: Callable[[str, int, int, int, int, int], StrategyCost]
    # (axis, layout) -> what the axis's plugin estimates for one rank (plait_axis_cost)
    axis_cost: Callable[[str, Layout], AxisCost]


def plugin_axis_cost(
    hook, cfg, model: torch.nn.Module, seq_len: int, precision: str, nodes=None
) -> Callable[[str, Layout], AxisCost]:
    """``(axis, layout) -> AxisCost``: what the active plugins answer to ``plait_axis_cost``
    (the first answer; 0 where none answers, and the plan every candidate gets names the gap).
    ``nodes``: ``launcher.nnodes`` parsed, carried by each layout's dims."""

    def axis_cost(axis: str, layout: Layout) -> AxisCost:
        world = layout.dp * layout.cp * layout.tp * layout.pp
        dims = ParallelDims(
            dp=layout.dp,
            tp=layout.tp,
            pp=layout.pp,
            cp=layout.cp,
            ep=layout.ep,
            world_size=world,
            nnodes=nodes.max if nodes else 1,
            nodes=nodes,
        )
        found = hook.plait_axis_cost(
            cfg=cfg,
            axis=axis,
            model=model,
            dims=dims,
            seq_len=seq_len,
            micro_batch_size=layout.micro_batch_size,
            microbatches=layout.microbatches,
            bytes_per_value=BYTES_PER_VALUE[precision],
            recompute=layout.activation_checkpointing,
        )
        return next((answer for answer in found if answer is not None), AxisCost(0.0))

    return axis_cost


def cost(layout: Layout, work: Workload) -> Cost:
    model, s, v = work.model, work.seq_len, BYTES_PER_VALUE[work.precision]
    dp, tp, pp, b, m = layout.dp, layout.tp, layout.pp, layout.micro_batch_size, layout.microbatches
    cp = layout.cp
    states = work.strategy_cost(layout.strategy, dp, tp, pp, cp, layout.ep)
    axes = {axis: work.axis_cost(axis, layout) for axis in AXES if getattr(layout, axis) > 1}
    recompute = layout.activation_checkpointing
    count = getattr(model, "activation_bytes", None)
    activations = 0
    if callable(count):
        in_flight = axes["pp"].in_flight if "pp" in axes else 1
        kwargs = {} if recompute == "none" else {"recompute": recompute}
        activations = count(b, s, v, **kwargs) // tp // pp // cp * in_flight

    f = flops_per_token(model, s)
    attention = f - flops_per_token(model, 0)
    r = {"none": 0.0, "full": f / 3, "selective": attention / 3}[recompute]
    compute = (f + r) * work.batch_size * s / (dp * cp * tp * pp) / work.peak_flops
    bubble = compute * (pp - 1) / m

    sent = states.dp_bytes_per_step
    for axis_cost in axes.values():
        sent += axis_cost.bytes_per_step
    return Cost(states.device_bytes + activations, compute, bubble, sent / work.bandwidth)
