"""A ``transformers`` model's own parallel plans, read as plait's.

Since ``transformers`` 4.5x every causal-LM config carries ``base_model_tp_plan`` and
``base_model_pp_plan``, and the ``*ForCausalLM`` class adds its head (``_tp_plan``,
``_pp_plan``); the built model merges them under its module names (``model.tp_plan``,
``model.pp_plan``: ``{"model.layers.*.self_attn.q_proj": "colwise", ...}``,
``{"model.embed_tokens": (["input_ids"], ["inputs_embeds"]), "model.layers": ..., ...}``).

Tensor parallelism: each style name of ``transformers.distributed.tensor_parallel`` maps onto a
plait (Megatron-style) style with the same math on plain tensors (:mod:`plait.plugins.
tensor_parallel.plan`):

==============================  ===================================================================
transformers                    plait
==============================  ===================================================================
``colwise``                     ``colwise`` (output features split, output stays split)
``rowwise``                     ``rowwise`` (input features split, all-reduce)
``colwise_gather_output``,      ``colwise_gather_output`` (split, then all-gather the output);
``colwise_rep``                 on the output embedding (``lm_head``) ``vocab`` instead: the
                                logits stay split over the vocabulary and the loss is the
                                vocab-parallel cross-entropy (Megatron's), the same loss without
                                gathering ``[batch, seq, vocab]``
``rowwise_split_input``,        ``rowwise_split_input`` (each rank keeps its slice of the whole
``rowwise_rep``                 input, then all-reduce)
``embedding_rowwise``           ``vocab`` (vocab-parallel embedding)
``mla_kv_a_proj``               ``mla_kv_a_proj`` (multi-head latent attention's down-projection,
                                whole; the gradient of its rotary-key features summed over tp)
``replicate``                   ``replicate``
==============================  ===================================================================

Every other style (``packed_colwise``, ``packed_rowwise``, ``moe_tp_experts``,
``moe_identity_expert``, ``replicated_with_grad_allreduce``,
``sequence_parallel``, ``embedding_colwise``, ``all_reduce``, ``local_params``, and any name a
later ``transformers`` adds) is refused by name before launch, never guessed. Only module entries
are read; a plan entry naming a parameter is refused too.

Pipeline stages: the ``pp_plan`` entry whose module is a ``ModuleList`` is the layer list; the
entries registered before it are the first stage's parts (embeddings), those after it the last
stage's (final norm, head). The decoder layers take the rotary embedding and the mask from the
model's forward, so they cannot be timed alone (``pipeline.balance=time`` is refused).
"""

from __future__ import annotations

from fnmatch import fnmatchcase

import torch.nn as nn

TO_PLAIT = {
    "colwise": "colwise",
    "rowwise": "rowwise",
    "colwise_gather_output": "colwise_gather_output",
    "colwise_rep": "colwise_gather_output",
    "rowwise_split_input": "rowwise_split_input",
    "rowwise_rep": "rowwise_split_input",
    "embedding_rowwise": "vocab",
    "mla_kv_a_proj": "mla_kv_a_proj",
    "replicate": "replicate",
}
EXPERTS = "plait spreads a mixture of experts' experts with parallel.ep, not by tensor parallelism"
FUSED_EXPERTS = ("experts.gate_up_proj", "experts.down_proj")  # split by parallel.ep instead
UNTIL = {  # why a style is refused
    "packed_colwise": EXPERTS,
    "packed_rowwise": EXPERTS,
    "moe_tp_experts": EXPERTS,
    "moe_identity_expert": EXPERTS,
}


def unsupported_styles(tp_plan: dict[str, str]) -> dict[str, str]:
    """``{pattern: style}`` of the entries plait cannot honour."""
    return {pattern: style for pattern, style in tp_plan.items() if style not in TO_PLAIT}


def tensor_parallel_plan(model: nn.Module) -> dict[str, str] | None:
    """plait's plan for ``model`` from its merged ``tp_plan``; None when it has none. Entries
    plait cannot honour are left out: the plugin refuses them by name before launch
    (:func:`refusals`)."""
    tp_plan = dict(getattr(model, "tp_plan", None) or {})
    if not tp_plan:
        return None
    head = output_embedding_name(model)
    names = [name for name, _ in model.named_modules()]
    plan = {}
    for pattern, style in tp_plan.items():
        if style not in TO_PLAIT or pattern.endswith(FUSED_EXPERTS):
            continue
        if not any(fnmatchcase(name, pattern) for name in names):
            continue  # a module this config leaves out (MiniCPM3's q_proj beside q_lora_rank)
        mapped = TO_PLAIT[style]
        if pattern == head and mapped in ("colwise", "colwise_gather_output"):
            mapped = "vocab"
        plan[pattern] = mapped
    return plan


def give_rotary_key_widths(model: nn.Module, plan: dict[str, str] | None) -> None:
    """The modules the plan gives ``mla_kv_a_proj`` learn the width of their rotary key
    (``qk_rope_head_dim``), which the tensor-parallel layer needs (``transformers`` hands them
    the config for it)."""
    patterns = [p for p, style in (plan or {}).items() if style == "mla_kv_a_proj"]
    if not patterns:
        return
    width = model.config.get_text_config().qk_rope_head_dim
    for name, module in model.named_modules():
        if any(fnmatchcase(name, p) for p in patterns):
            module.qk_rope_head_dim = width


def output_embedding_name(model: nn.Module) -> str | None:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return next((name for name, m in model.named_modules() if m is head), None)


def refusals(model: nn.Module, tp: int, arch: str) -> list[str]:
    """Why ``parallel.tp`` cannot split this architecture: no plan, or styles plait does not
    honour (each named)."""
    tp_plan = dict(getattr(model, "tp_plan", None) or {})
    if not tp_plan:
        return [
            f"parallel.tp={tp}: {arch} has no base_model_tp_plan in its config: set "
            "parallel.tp=1, or give tensor_parallel.plan={module pattern: style}"
        ]
    problems = []
    parameters = {name for name, _ in model.named_parameters()}
    for pattern, style in unsupported_styles(tp_plan).items():
        why = UNTIL.get(style, "plait has no layer for it yet")
        problems.append(
            f"parallel.tp={tp}: {arch}'s tensor-parallel plan gives {pattern!r} the "
            f"style {style!r}, which plait does not honour ({why}): set "
            "parallel.tp=1"
        )
    for pattern in tp_plan:
        if pattern in parameters:
            problems.append(
                f"parallel.tp={tp}: {arch}'s tensor-parallel plan names the "
                f"parameter {pattern!r}; plait splits modules only: set "
                "parallel.tp=1"
            )
    return problems


def pipeline_plan(model: nn.Module) -> dict | None:
    """plait's pipeline plan (first parts, layer list, last parts) from the model's merged
    ``pp_plan``, ordered as the modules are registered; None without a pp plan or a
    ``ModuleList`` in it."""
    pp_plan = dict(getattr(model, "pp_plan", None) or {})
    if not pp_plan:
        return None
    modules = dict(model.named_modules())
    order = {name: i for i, name in enumerate(modules)}
    names = sorted((n for n in pp_plan if n in modules), key=order.__getitem__)
    lists = [n for n in names if isinstance(modules[n], nn.ModuleList)]
    if len(lists) != 1:
        return None
    layers = lists[0]
    return {
        "first": [n for n in names if order[n] < order[layers]],
        "layers": layers,
        "last": [n for n in names if order[n] > order[layers]],
        "layers_run_alone": False,
    }
