"""Mixture-of-experts layers for plait's GPT: a router, routed experts, an optional shared expert.

A block's MLP becomes ``blocks.<i>.mlp`` = :class:`MoE` with

- ``router``: ``nn.Linear(n_embd, E, bias=False)``, logits ``z = x W_rᵀ`` per token;
- ``experts``: a ``ModuleDict`` of MLPs keyed by the expert's *global* index (``experts.5.fc``),
  so that a rank holding a share of the experts (expert parallelism) names each as the whole
  model does: initial values (by name, :mod:`plait.meta`) and checkpoints do not depend on ``ep``;
- ``shared`` (``model.shared_expert``): one more MLP every token goes through (DeepSeek-MoE,
  Qwen2-MoE), added to the routed output.

Routing (Megatron-core's ``TopKRouter``, ``moe_utils``), for ``T`` tokens, ``E`` experts, top ``k``:

    softmax:  p = softmax(z);  experts = topk(p, k);  gates = p[experts]        (Switch, Mixtral
              without renormalising)
    sigmoid:  s = sigmoid(z);  experts = topk(s, k);  gates = s[experts] / Σ s[experts]
              and p = s / Σ_e s for the auxiliary loss                          (DeepSeek-V3)

    aux  = E · Σ_i f_i · P_i,  f_i = c_i / (T·k),  P_i = (1/T) Σ_x p(x, i)     (Switch Transformer)
           c_i: the router's choices of expert i (before any capacity drop)
    z    = (1/T) Σ_x (log Σ_i exp z(x, i))²                                      (ST-MoE)

Both are added to the objective as ``model.aux_loss_coeff · aux + model.z_loss_coeff · z`` through
:class:`AuxLossScaler` (Megatron's ``MoEAuxLossAutoScaler``): the layer's output is unchanged and
its backward adds ``aux_loss_scale`` times the losses' gradient, so the losses reach the router on
every pipeline stage without entering the reported ``loss`` (the cross-entropy). An engine that
backpropagates ``loss / m`` for each of ``m`` micro-batches sets ``aux_loss_scale = 1/m``.

Dropless by default: every choice is computed. With ``model.capacity_factor=c`` each expert takes
at most ``ceil(c · T · k / E)`` of this rank's choices per micro-batch, the first ones in token
order; the others are dropped (their gate's share of the output is zero, the residual carries the
token on). Tokens are sorted by expert and handed to ``dispatcher`` (:class:`LocalDispatcher`:
every expert is here; expert parallelism installs an all-to-all one), which returns the experts'
outputs in the same order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

ROUTERS = ("softmax", "sigmoid")


@dataclass
class Routing:
    """The router's decision for ``T`` tokens (``k`` choices each)."""

    experts: torch.Tensor  # [T, k] int64: chosen experts
    gates: torch.Tensor  # [T, k]: each choice's weight (differentiable)
    kept: torch.Tensor  # [T, k] bool: not dropped by the capacity
    probs: torch.Tensor  # [T, E]: p(x, i) of the auxiliary loss (differentiable)
    chosen_per_expert: torch.Tensor  # [E] int64: c_i, the choices before any drop
    tokens_per_expert: torch.Tensor  # [E] int64: choices each expert computes (after drops)

    @property
    def dropped(self) -> int:
        return int((~self.kept).sum())


def capacity(tokens: int, n_experts: int, top_k: int, capacity_factor: float) -> int:
    """Each expert's capacity for ``tokens`` tokens: ``ceil(c · T · k / E)`` (Megatron's
    ``get_capacity`` over the ``T·k`` choices)."""
    return math.ceil(capacity_factor * tokens * top_k / n_experts)


def route(
    logits: torch.Tensor, top_k: int, router: str = "softmax", capacity_factor: float | None = None
) -> Routing:
    """Top-``k`` routing of ``logits`` ``[T, E]`` (computed in fp32), see the module docstring."""
    logits = logits.float()
    n_tokens, n_experts = logits.shape
    if router == "softmax":
        probs = logits.softmax(dim=-1)
        gates, experts = probs.topk(top_k, dim=-1)
    elif router == "sigmoid":
        scores = logits.sigmoid()
        top, experts = scores.topk(top_k, dim=-1)
        gates = top / top.sum(dim=-1, keepdim=True)
        probs = scores / scores.sum(dim=-1, keepdim=True)
    else:
        raise ValueError(f"model.router={router}: choose one of {', '.join(ROUTERS)}")
    flat = experts.flatten()
    chosen = torch.bincount(flat, minlength=n_experts)
    kept = torch.ones_like(experts, dtype=torch.bool)
    if capacity_factor is not None:
        # the position of each choice among its expert's choices, in token order
        onehot = F.one_hot(flat, n_experts)
        position = (onehot.cumsum(dim=0) * onehot).sum(dim=-1) - 1
        limit = capacity(n_tokens, n_experts, top_k, capacity_factor)
        kept = (position < limit).view_as(experts)
    computed = torch.bincount(flat[kept.flatten()], minlength=n_experts)
    return Routing(experts, gates, kept, probs, chosen, computed)


def load_balancing_loss(routing: Routing, top_k: int) -> torch.Tensor:
    """``E · Σ_i f_i · P_i`` (the Switch Transformer's auxiliary loss, Megatron's
    ``switch_load_balancing_loss_func``): minimal, 1, when the choices and the probabilities
    are both uniform over the experts."""
    n_tokens, n_experts = routing.probs.shape
    f = routing.chosen_per_expert.float() / (n_tokens * top_k)
    p = routing.probs.mean(dim=0)
    return n_experts * (f * p).sum()


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """``mean_x (logsumexp_i z(x, i))²`` (ST-MoE's router z-loss, Megatron's ``z_loss_func``)."""
    return logits.float().logsumexp(dim=-1).square().mean()


class AuxLossScaler(torch.autograd.Function):
    """Identity on ``output``; its backward also gives ``loss`` the gradient ``scale``, which
    adds ``scale · loss`` to the objective being differentiated (Megatron's
    ``MoEAuxLossAutoScaler``, with the scale passed per call instead of held in a class)."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.loss_shape = loss.shape
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.full(ctx.loss_shape, ctx.scale, device=grad.device), None


@dataclass
class MoEStats:
    """What a layer saw in each training forward since the last :meth:`reset` (this rank's
    tokens), one row per forward: tokens computed per expert, dropped choices, the unweighted
    load-balancing and z-losses. The expert-parallel plugin sums a step's rows over ranks."""

    rows: list[torch.Tensor] = field(default_factory=list)  # [E + 3] float64 each

    def add(self, routing: Routing, aux: torch.Tensor, z: torch.Tensor) -> None:
        extra = torch.tensor(
            [routing.dropped, float(aux.detach()), float(z.detach())], dtype=torch.float64
        )
        self.rows.append(torch.cat([routing.tokens_per_expert.detach().cpu().double(), extra]))

    def last(self, forwards: int) -> list[torch.Tensor]:
        """The rows of the last ``forwards`` forwards: a step's micro-batches (a pipeline's first
        step also runs each stage once on placeholder inputs to learn the shapes)."""
        return self.rows[-forwards:]

    def reset(self) -> None:
        self.rows.clear()


def in_backward() -> bool:
    """A forward run again inside the backward pass (activation checkpointing's recompute),
    whose routing must not be counted twice."""
    return torch._C._current_graph_task_id() != -1


class LocalDispatcher:
    """Every expert is on this rank: ``tokens`` sorted by expert, ``counts[e]`` of them for expert
    ``e``, go through their expert; the outputs come back in the same order."""

    def __call__(
        self, tokens: torch.Tensor, counts: torch.Tensor, experts: nn.ModuleDict
    ) -> torch.Tensor:
        chunks = tokens.split(counts.tolist())
        return torch.cat([experts[str(e)](chunk) for e, chunk in enumerate(chunks)])


class MoE(nn.Module):
    """A mixture-of-experts MLP: ``y = Σ_{kept choices} gate · expert(x) [+ shared(x)]``.

    The contract the expert-parallel plugin relies on (any model's MoE layer may follow it):
    ``is_moe_layer``, ``n_experts``, ``layer_index``, ``experts`` (a ``ModuleDict`` keyed by
    global expert index, which it may cut to this rank's share), ``dispatcher`` (replaceable),
    ``stats`` (:class:`MoEStats`) and ``aux_loss_scale``.
    """

    is_moe_layer = True

    def __init__(
        self,
        n_embd: int,
        n_experts: int,
        top_k: int,
        make_expert: Callable[[], nn.Module],
        shared_expert: bool = False,
        router: str = "softmax",
        aux_loss_coeff: float = 0.0,
        z_loss_coeff: float = 0.0,
        capacity_factor: float | None = None,
        layer_index: int = 0,
    ):
        super().__init__()
        if router not in ROUTERS:
            raise ValueError(f"model.router={router}: choose one of {', '.join(ROUTERS)}")
        if not 1 <= top_k <= n_experts:
            raise ValueError(
                f"model.top_k={top_k} must be between 1 and model.n_experts={n_experts}"
            )
        self.n_experts, self.top_k, self.router_kind = n_experts, top_k, router
        self.aux_loss_coeff, self.z_loss_coeff = aux_loss_coeff, z_loss_coeff
        self.capacity_factor, self.layer_index = capacity_factor, layer_index
        self.router = nn.Linear(n_embd, n_experts, bias=False)
        self.experts = nn.ModuleDict({str(e): make_expert() for e in range(n_experts)})
        self.shared = make_expert() if shared_expert else None
        self.dispatcher: Callable = LocalDispatcher()
        self.stats = MoEStats()
        self.aux_loss_scale = 1.0  # the engine's backward scale of one micro-batch's loss
        self.record_stats = True  # record the routing in stats (the engine: on logged steps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        logits = self.router(tokens)
        routing = route(logits, self.top_k, self.router_kind, self.capacity_factor)
        out = routed_output(tokens, routing, self.dispatcher, self.experts)
        if self.shared is not None:
            out = out + self.shared(tokens)
        return router_losses_and_stats(self, out, routing, logits).view_as(x)


def routed_output(
    tokens: torch.Tensor, routing: Routing, dispatcher: Callable, experts: nn.ModuleDict
) -> torch.Tensor:
    """Sort the kept choices by expert, run them through ``dispatcher``, and sum each token's
    outputs weighted by their gates."""
    k = routing.experts.shape[1]
    kept = routing.kept.flatten()
    chosen = routing.experts.flatten()[kept]
    order = torch.argsort(chosen, stable=True)
    token_of = torch.arange(tokens.shape[0], device=tokens.device).repeat_interleave(k)[kept][order]
    gates = routing.gates.flatten()[kept][order].to(tokens.dtype)
    outputs = dispatcher(tokens[token_of], routing.tokens_per_expert, experts)
    return torch.zeros_like(tokens).index_add(0, token_of, outputs * gates.unsqueeze(-1))


def router_losses_and_stats(
    layer: nn.Module, out: torch.Tensor, routing: Routing, logits: torch.Tensor
) -> torch.Tensor:
    """``out`` carrying ``layer``'s weighted auxiliary losses into the backward (a training
    forward with ``aux_loss_coeff`` or ``z_loss_coeff``), the routing recorded in ``layer.stats``
    (a training forward not recomputed in the backward)."""
    aux = load_balancing_loss(routing, routing.experts.shape[1])
    z = z_loss(logits)
    if layer.training and torch.is_grad_enabled():
        if layer.aux_loss_coeff or layer.z_loss_coeff:
            weighted = layer.aux_loss_coeff * aux + layer.z_loss_coeff * z
            out = AuxLossScaler.apply(out, weighted, layer.aux_loss_scale)
        if not in_backward() and getattr(layer, "record_stats", True):
            layer.stats.add(routing, aux, z)  # reads the losses: a device sync on a GPU
    return out


def moe_layers(model: nn.Module) -> list[nn.Module]:
    """The model's mixture-of-experts layers (modules with ``is_moe_layer``), in model order."""
    return [m for m in model.modules() if getattr(m, "is_moe_layer", False)]
