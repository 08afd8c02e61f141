"""Hugging Face mixture-of-experts blocks (Qwen3-MoE, Mixtral) under plait's expert contract,
found through the config's ``base_model_ep_plan``.

``transformers`` 5 keeps a layer's experts fused: ``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` and
``mlp.experts.down_proj`` ``[E, H, I]``, and its ep plan gives those two parameters the style
``grouped_gemm`` (``Shard(0)``: whole experts per rank, along the expert dim) and the experts
module the style ``ep_dispatch_experts`` (its forward replaced by an all-to-all of the tokens,
``transformers.distributed.expert_parallel.AllToAllEP``). Its checkpoints store each expert
apart (``mlp.experts.<e>.gate_proj.weight``; Mixtral's ``block_sparse_moe.experts.<e>.w1.weight``),
fused on load by the model's conversion mapping (``MergeModulelist(dim=0)``, ``Concatenate(dim=1)``)
and split again by ``save_pretrained``.

plait reads the same plan the same way, with its own expert contract
(:class:`plait.plugins.models.moe.MoE`) instead of DTensors: each block the plan names (the parent
of an ``ep_dispatch_experts`` module) gets its experts as a ``ModuleDict`` of one MLP per expert,
keyed by global index, under the checkpoint's own names (read from the conversion mapping's
sources), so that

- ``parallel.ep`` keeps a rank's ``E/ep`` experts and reads only their tensors from safetensors
  (the ``grouped_gemm`` split along the expert dim, as whole tensors of the stored checkpoint);
- tokens reach them through plait's ``all_to_all_single`` dispatcher (``ep_dispatch_experts``);
- checkpoints and exports hold every expert once under its global name, at any ``ep``;
- ZeRO's expert groups, DDP's and FSDP's expert averaging apply as to plait's GPT-MoE.

The block keeps its own router (``gate``: softmax, top-k, Mixtral's and ``norm_topk_prob``'s
renormalisation, exactly ``transformers``') and Mixtral's router jitter; the experts compute
``down(act(gate(x)) * up(x))`` like ``transformers``' fused forward. Its auxiliary loss, when
the config asks for it (``output_router_logits``), is plait's per-layer Switch loss weighted by
``router_aux_loss_coef`` (``transformers`` pools every layer's routing into one loss and does not
divide by ``top_k``; the per-layer form is Megatron's and DeepSpeed-MoE's). The blocks served
are listed in :data:`SERVED_BLOCKS`; others (shared experts, grouped or biased routers, biased or
interleaved experts) keep ``transformers``' own block and are refused under ``parallel.ep``.
"""

from __future__ import annotations

import re

import torch
import torch.nn as nn

from plait.plugins.models.moe import (
    LocalDispatcher,
    MoEStats,
    Routing,
    routed_output,
    router_losses_and_stats,
)

SERVED_BLOCKS = ("Qwen3MoeSparseMoeBlock", "MixtralSparseMoeBlock")
EP_STYLES = ("grouped_gemm", "ep_dispatch_experts")  # expert weights by expert; their dispatch
FUSED = ("experts.gate_up_proj", "experts.down_proj")


def ep_plan(model: nn.Module) -> dict[str, str]:
    """The model's merged ``base_model_ep_plan`` (``transformers``' ``model.ep_plan``), by the
    names of the model as ``transformers`` built it."""
    return dict(getattr(model, "ep_plan", None) or {})


def matches(pattern: str, name: str) -> bool:
    return re.fullmatch(re.escape(pattern).replace(r"\*", r"[^.]+"), name) is not None


def planned_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, block)`` of each mixture-of-experts block: the parent of a module the ep plan
    gives ``ep_dispatch_experts``, in model order."""
    patterns = [p for p, style in ep_plan(model).items() if style == "ep_dispatch_experts"]
    modules = dict(model.named_modules())
    blocks = []
    for name in modules:
        if any(matches(p, name) for p in patterns):
            parent = name.rpartition(".")[0]
            blocks.append((parent, modules[parent]))
    return blocks


def expert_names(model: nn.Module) -> tuple[str, str, str] | None:
    """The stored names of one expert's gate, up and down projections (``gate_proj``,
    ``up_proj``, ``down_proj``; Mixtral's ``w1``, ``w3``, ``w2``), from the sources of the
    conversion mapping's converters that fuse them; None when it has no such converters."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter

    from plait.plugins.hf.model import as_transformers_class

    with as_transformers_class(model):
        transforms = get_model_conversion_mapping(model)
    sources = {}
    for t in transforms:
        if isinstance(t, WeightConverter):
            for target in t._original_target_patterns:
                for fused in FUSED:
                    if target.endswith(fused):
                        sources[fused] = [
                            s.rsplit("*.", 1)[-1].removesuffix(".weight")
                            for s in t._original_source_patterns
                        ]
    gate_up, down = sources.get(FUSED[0], []), sources.get(FUSED[1], [])
    if len(gate_up) != 2 or len(down) != 1:
        return None
    return gate_up[0], gate_up[1], down[0]


def unserved_reason(block: nn.Module, names) -> str | None:
    """Why plait cannot put ``block`` under its expert contract, or None."""
    kind = type(block).__name__
    if kind not in SERVED_BLOCKS:
        return f"its block {kind} is not one plait serves ({', '.join(SERVED_BLOCKS)})"
    if names is None:
        return "transformers' conversion mapping names no per-expert gate, up and down weights"
    fused = {n for n, _ in block.experts.named_parameters()}
    if fused != {"gate_up_proj", "down_proj"}:
        return f"its experts hold {sorted(fused)}, not gate_up_proj and down_proj alone"
    return None


class ExpertMLP(nn.Module):
    """One expert: ``down(act(gate(x)) * up(x))``, its projections under the checkpoint's names
    (``transformers``' fused ``gate_up_proj[e]`` is ``[gate; up]``, ``down_proj[e]`` is down)."""

    def __init__(
        self, hidden: int, intermediate: int, act_fn: nn.Module, names: tuple[str, str, str]
    ):
        super().__init__()
        self.names = names
        gate, up, down = names
        setattr(self, gate, nn.Linear(hidden, intermediate, bias=False))
        setattr(self, up, nn.Linear(hidden, intermediate, bias=False))
        setattr(self, down, nn.Linear(intermediate, hidden, bias=False))
        self.act_fn = act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = (getattr(self, n) for n in self.names)
        return down(self.act_fn(gate(x)) * up(x))


class PlaitMoEBlock:
    """plait's expert contract (``is_moe_layer``, ``n_experts``, ``layer_index``, ``experts`` by
    global index, ``dispatcher``, ``stats``, ``aux_loss_scale``), mixed into a ``transformers``
    sparse MoE block; its router (``gate``) stays the model's own."""

    is_moe_layer = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        jitter = getattr(self, "jitter_noise", 0.0)
        if self.training and jitter > 0:  # Mixtral's router jitter, as its own block applies it
            hidden_states = hidden_states * torch.empty_like(hidden_states).uniform_(
                1.0 - jitter, 1.0 + jitter
            )
        tokens = hidden_states.reshape(-1, shape[-1])
        logits, gates, chosen = self.gate(tokens)
        counts = torch.bincount(chosen.flatten(), minlength=self.n_experts)
        routing = Routing(
            chosen,
            gates,
            torch.ones_like(chosen, dtype=torch.bool),
            logits.float().softmax(dim=-1),
            counts,
            counts,
        )
        out = routed_output(tokens, routing, self.dispatcher, self.experts)
        return router_losses_and_stats(self, out, routing, logits).view(shape)


_CLASSES: dict[type, type] = {}


def plait_block_class(base: type) -> type:
    """``base`` with :class:`PlaitMoEBlock` mixed in, under the same name, a name of this module
    (so it pickles)."""
    if base not in _CLASSES:
        cls = type(base.__name__, (PlaitMoEBlock, base), {"__module__": __name__})
        globals()[cls.__name__] = cls
        _CLASSES[base] = cls
    return _CLASSES[base]


def layer_index(name: str) -> int:
    numbers = [int(part) for part in name.split(".") if part.isdigit()]
    return numbers[-1] if numbers else 0


def adopt_experts(model: nn.Module) -> list[str]:
    """Put every served block of ``model`` under plait's expert contract, on the device the model
    was built on (meta, in plait); the names of the blocks adopted. Unserved blocks stay as
    ``transformers`` built them."""
    blocks = planned_blocks(model)
    if not blocks:
        return []
    names = expert_names(model)
    config = model.config.get_text_config()
    aux = config.router_aux_loss_coef if getattr(config, "output_router_logits", False) else 0.0
    adopted = []
    for name, block in blocks:
        if unserved_reason(block, names) is not None:
            continue
        fused = block.experts
        n_experts, hidden = fused.num_experts, fused.hidden_dim
        device = fused.down_proj.device
        with torch.device(device):
            experts = nn.ModuleDict(
                {
                    str(e): ExpertMLP(hidden, fused.intermediate_dim, fused.act_fn, names)
                    for e in range(n_experts)
                }
            )
        block.experts = experts
        block.__class__ = plait_block_class(type(block))
        block.n_experts, block.top_k = n_experts, block.gate.top_k
        block.layer_index = layer_index(name)
        block.aux_loss_coeff, block.z_loss_coeff = aux, 0.0
        block.dispatcher, block.stats, block.aux_loss_scale = LocalDispatcher(), MoEStats(), 1.0
        adopted.append(name)
        model.n_experts = n_experts  # what the planner enumerates parallel.ep against
    return adopted


def kept_converters(model: nn.Module, converters: list) -> list:
    """The conversion mapping's converters still needed to read a checkpoint into ``model``:
    those fusing the experts of adopted blocks are not (their experts are read one by one)."""
    if not getattr(model, "plait_expert_blocks", None):
        return converters
    return [
        c for c in converters if not any(t.endswith(FUSED) for t in c._original_target_patterns)
    ]


def expert_parameter_count(model: nn.Module) -> int:
    """Parameters of the adopted blocks' routed experts, for plait's estimates
    (:func:`plait.meta.parameters_per_rank`)."""
    return sum(
        p.numel()
        for m in model.modules()
        if getattr(m, "is_moe_layer", False)
        for p in m.experts.parameters()
    )


def refusals(cfg, model: nn.Module, dims) -> list[str]:
    """Why ``parallel.ep`` cannot spread this model's experts: no ep plan, styles plait does not
    honour, blocks it does not serve, expert counts ep does not divide, context parallelism."""
    arch, path, ep = model.plait_architecture, cfg.model.path, dims.ep
    plan = ep_plan(model)
    if not plan:
        return [
            f"parallel.ep={ep}: {arch} (model.path={path}) has no base_model_ep_plan in its "
            "config, so it has no mixture-of-experts layers to spread: set parallel.ep=1"
        ]
    problems = [
        f"parallel.ep={ep}: {arch}'s expert-parallel plan gives {pattern!r} the style "
        f"{style!r}, which plait does not honour (it honours {', '.join(EP_STYLES)}): "
        "set parallel.ep=1"
        for pattern, style in plan.items()
        if style not in EP_STYLES
    ]
    names = expert_names(model)
    blocks = planned_blocks(model)
    for name, block in blocks:
        why = None if getattr(block, "is_moe_layer", False) else unserved_reason(block, names)
        if why is not None:
            problems.append(
                f"parallel.ep={ep}: {arch}'s mixture-of-experts block {name} cannot "
                f"be spread by plait: {why}: set parallel.ep=1"
            )
            break
    adopted = [m for m in model.modules() if getattr(m, "is_moe_layer", False)]
    if not adopted and not problems:
        return [
            f"parallel.ep={ep}: {arch}'s base_model_ep_plan {sorted(plan)} names no "
            "mixture-of-experts block plait adopted: set parallel.ep=1"
        ]
    counts = sorted({m.n_experts for m in adopted})
    for n in counts:
        if n % ep:
            fits = [e for e in range(1, dims.dp + 1) if dims.dp % e == 0 and n % e == 0]
            problems.append(
                f"parallel.ep={ep} does not divide the {n} experts per layer of "
                f"model.path={path} (num_experts in its config.json): each "
                f"expert-parallel rank holds num_experts/ep experts; choose "
                f"parallel.ep in {fits}"
            )
    if adopted and dims.cp > 1:
        problems.append(
            f"parallel.ep={ep} with parallel.cp={dims.cp}: expert parallelism is "
            "carved out of the dp ranks alone, not the dp x cp ranks that share "
            "gradients (not built): set parallel.ep=1 or parallel.cp=1"
        )
    return problems


def loss_problems(cfg, model: nn.Module) -> list[str]:
    """The adopted blocks' load-balancing loss (``output_router_logits``) under fp16, at any
    ``ep`` (as for plait's GPT-MoE)."""
    weighted = any(
        getattr(m, "aux_loss_coeff", 0)
        for m in model.modules()
        if getattr(m, "is_moe_layer", False)
    )
    if cfg.precision != "fp16" or not weighted:
        return []
    return [
        f"precision=fp16 with model.path={cfg.model.path}'s router load-balancing loss "
        "(output_router_logits in its config.json): the router's auxiliary losses enter the "
        "backward unscaled by the fp16 loss scale; use precision=bf16 or fp32"
    ]
