"""``model=hf parallel.cp=C``: context parallelism for ``transformers`` models whose attention
runs through ``transformers``' attention interface (Llama, Qwen2/3, Mistral, Phi-3, GPT-NeoX, ...).

A ``transformers`` attention module projects ``q, k, v``, rotates ``q`` and ``k`` by the rotary
embedding of the ``position_ids`` its base model was given, and hands them to the function its
config names, ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, q, k, v,
attention_mask, dropout=, scaling=, **kwargs)``. That function is the attention core, but it is
not a module the context-parallel plan could name, so plait gives every causal attention module
a parameter-free ``core_attention`` (:class:`AttentionCore`: ``softmax(q·kᵀ·scaling + causal
mask)·v``, grouped-query heads as they are) and registers :func:`core_attention_forward`, which
calls it, as the attention implementation ``plait_context_parallel``. The model's plan::

    {"model": "sequence_split",                                  # the base model
     "model.layers.0.self_attn.core_attention": "attention", ...} # every attention module

Under ``parallel.cp > 1`` the hf plugin points the model's config at ``plait_context_parallel``
(:func:`use_core_attention`) and the context-parallel plugin does the rest as for plait's GPT
(:mod:`plait.plugins.context_parallel.apply`): the base model gets this rank's token ids and
their positions in the sequence as ``position_ids``, so the rotary embedding of each token is the
one of its place in the whole sequence (zigzag chunks included), and each ``core_attention`` is
replaced by ring attention or Ulysses; with grouped-query attention only the key/value heads
travel. ``transformers`` builds no mask for an implementation it has no mask function for
(``masking_utils``: "custom attention without equivalent mask creation"), so the causal mask is
the exchange's own. Without cp nothing changes: the config keeps ``sdpa`` and the cores are
never called.

A model is served when its exact attention is that causal softmax over every earlier token
(:func:`no_plan_reason`, read off the class and the config, refused before launch): its class
calls the attention interface (``transformers``' own test, ``_can_set_attn_implementation``) and
allows context parallelism (``_supports_context_parallel``, false for attention sinks), it has
causal attention modules with a ``scaling`` and no parameters of their own inside the softmax
(sinks), no logit soft-capping, and its layers are full or sliding-window attention; a window
shorter than ``train.seq_len`` and attention dropout are refused with the run's settings
(:func:`problems`). Written here: the core, the function and
these checks; taken from ``transformers``: the attention interface, the rotary embeddings of
given ``position_ids``, and the mask creation that stands aside for a custom implementation.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

NAME = "plait_context_parallel"
CORE = "core_attention"
LAYER_TYPES = ("full_attention", "sliding_attention")


class AttentionCore(nn.Module):
    """``softmax(q·kᵀ·scale + causal mask)·v`` over ``[b, heads, seq, d]``; ``k`` and ``v`` may
    have fewer heads (grouped-query attention). What ring attention computes tile by tile with
    ``scale`` and what Ulysses runs over the whole sequence with ``H/C`` of the heads."""

    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        documents: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if documents is not None:
            raise ValueError("transformers models take no packed documents here")
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=self.scale, enable_gqa=k.shape[1] != q.shape[1]
        )


UNHONOURED = ("softcap", "s_aux", "sinks")  # keywords an attention function may be asked to apply


def core_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The attention implementation ``plait_context_parallel``: ``module.core_attention`` on
    ``q, k, v`` (``[b, heads, seq, d]``), the output ``[b, seq, heads, d]`` as every
    ``transformers`` attention function returns it, and no weights. What it cannot honour was
    refused before launch; should it arrive anyway, it raises rather than compute something
    else."""
    core = getattr(module, CORE)
    layout = getattr(core, "layout", None)
    seq_len = layout.seq_len if layout is not None else query.shape[2]
    asked = [k for k in UNHONOURED if kwargs.get(k) is not None]
    if attention_mask is not None:
        asked.append("attention_mask")
    if dropout:
        asked.append(f"dropout={dropout}")
    if sliding_window is not None and sliding_window < seq_len:
        asked.append(f"sliding_window={sliding_window} < {seq_len} tokens")
    inner = getattr(core, "inner", core)
    if scaling is not None and scaling != inner.scale:
        asked.append(f"scaling={scaling} (the core's {inner.scale})")
    if asked:
        raise RuntimeError(
            f"{type(module).__name__} asks {NAME} for {', '.join(asked)}, which "
            "plait's context-parallel attention does not apply"
        )
    return core(query, key, value).transpose(1, 2).contiguous(), None


def register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, core_attention_forward)


def attention_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The model's causal attention modules: ``transformers``' ``*Attention`` classes with
    ``is_causal`` set."""
    return {
        name: m
        for name, m in model.named_modules()
        if type(m).__name__.endswith("Attention") and getattr(m, "is_causal", False)
    }


def no_plan_reason(model: nn.Module, config) -> str | None:
    """Why plait cannot replace this architecture's attention exactly, or None."""
    cls = getattr(type(model), "transformers_class", type(model))
    arch = cls.__name__
    if not cls._can_set_attn_implementation():
        return (
            f"{arch}'s attention does not go through transformers' attention interface "
            "(ALL_ATTENTION_FUNCTIONS), where plait puts its exchange"
        )
    if not getattr(cls, "_supports_context_parallel", True):
        return f"transformers marks {arch} as unable to run under context parallelism"
    modules = attention_modules(model)
    if not modules:
        return f"{arch} has no causal attention module (is_causal) for plait to replace"
    unscaled = [
        name for name, m in modules.items() if not isinstance(getattr(m, "scaling", None), float)
    ]
    if unscaled:
        return f"{arch}'s attention module {unscaled[0]} has no scaling"
    own = [
        f"{name}.{p}" for name, m in modules.items() for p, _ in m.named_parameters(recurse=False)
    ]
    if own:  # attention sinks (gpt-oss' s_aux) and the like enter the softmax itself
        return (
            f"{arch}'s attention module holds parameters of its own ({own[0]}) that enter "
            "its softmax"
        )
    text = config.get_text_config()
    if getattr(text, "attn_logit_softcapping", None) is not None:
        return f"{arch} soft-caps its attention logits (attn_logit_softcapping)"
    odd = sorted(set(getattr(text, "layer_types", None) or ()) - set(LAYER_TYPES))
    if odd:
        return (
            f"{arch} has {', '.join(odd)} layers (layer_types); plait's exchange computes "
            "full causal attention"
        )
    return None


def sliding_window(config) -> int | None:
    """The window of the model's sliding-window layers, None without one: models with
    ``layer_types`` use it on their ``sliding_attention`` layers, older ones (Mistral) on every
    layer whenever ``sliding_window`` is set."""
    text = config.get_text_config()
    layer_types = getattr(text, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return getattr(text, "sliding_window", None)


def prepare(model: nn.Module, config) -> None:
    """Give the model its context-parallel plan and ``n_head`` (with a ``core_attention`` on each
    attention module), or the reason it has none (``no_context_parallel_plan_reason``)."""
    reason = no_plan_reason(model, config)
    model.n_head = config.get_text_config().num_attention_heads
    if reason is not None:
        model.context_parallel_plan = None
        model.no_context_parallel_plan_reason = reason
        return
    register()
    plan = {model.base_model_prefix: "sequence_split"}
    for name, module in attention_modules(model).items():
        module.add_module(CORE, AttentionCore(module.scaling))
        plan[f"{name}.{CORE}"] = "attention"
    model.context_parallel_plan = plan


def use_core_attention(model: nn.Module) -> None:
    """Point ``transformers`` at the cores (``parallel.cp > 1``, once the plan is applied)."""
    register()  # in this process too: the model may have been built elsewhere and copied
    model.config._attn_implementation = NAME


def attention_dropout(model: nn.Module) -> tuple[str, float] | None:
    """The first attention module that drops out attention probabilities, and the rate: its
    ``attention_dropout`` (Llama-likes) or its ``attn_dropout`` / ``attention_dropout`` module
    (GPT-2, GPT-NeoX)."""
    for name, m in attention_modules(model).items():
        rate = getattr(m, "attention_dropout", None)
        if isinstance(rate, nn.Dropout):
            rate = rate.p
        dropout = getattr(m, "attn_dropout", None)
        if isinstance(dropout, nn.Dropout):
            rate = max(rate or 0.0, dropout.p)
        if rate:
            return name, float(rate)
    return None


def problems(cfg, model: nn.Module, config, cp: int) -> list[str]:
    """What the run's settings ask of the attention that the exchange does not compute."""
    found, path, seq_len = [], cfg.model.path, cfg.train.seq_len
    window = sliding_window(config)
    if window is not None and window < seq_len:
        found.append(
            f"parallel.cp={cp}: model.path={path} attends within a sliding window of "
            f"{window} tokens (sliding_window), shorter than train.seq_len={seq_len}; "
            "plait's context-parallel attention sees every earlier token: set "
            f"train.seq_len <= {window}, or parallel.cp=1"
        )
    dropout = attention_dropout(model)
    if dropout is not None:
        name, rate = dropout
        found.append(
            f"parallel.cp={cp}: model.path={path} drops out attention probabilities "
            f"({name}: {rate}); the attention of context-parallel ranks has no dropout "
            "on its probabilities: set the attention dropout of its config.json "
            "(attention_dropout, attn_pdrop, ...) to 0, or parallel.cp=1"
        )
    return found
