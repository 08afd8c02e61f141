"""Tensor-parallel plans: which submodule is split how (torchtitan's declarative plan).

A plan maps module-name patterns (``fnmatch``: ``blocks.*.attn.qkv``) to a *style*; the first
matching pattern wins, unmatched modules are replicated. Styles:

===================  ==========================================================================
``colwise``          ``nn.Linear`` → :class:`ColumnParallelLinear` (output features split)
``colwise_qkv``      the same for a fused ``[q; k; v]`` weight: each third split, whole heads
``rowwise``          ``nn.Linear`` → :class:`RowParallelLinear` (input features split)
``vocab``            ``nn.Embedding`` → :class:`VocabParallelEmbedding`; on the output
                     ``nn.Linear``: column-parallel over the vocabulary, logits stay split and
                     the loss is the vocab-parallel cross-entropy
``norm``             ``nn.LayerNorm`` inside the sequence-parallel region (only matters with
                     ``parallel.sequence_parallel``)
``sequence_scatter`` the module whose output enters the sequence-parallel region (its output is
                     split along the sequence under ``parallel.sequence_parallel``)
``replicate``        kept whole on every rank (overrides a later, broader pattern)
===================  ==========================================================================

The same table decides how a checkpoint's shards merge back (:func:`merge_shards`), so the split
and the merge cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any, Callable, Mapping

import torch
import torch.nn as nn

STYLES = ("colwise", "colwise_qkv", "rowwise", "vocab", "norm", "sequence_scatter", "replicate")

GPT_TARGET = "plait.plugins.models.gpt.GPT"
LLAMA_TARGET = "plait.plugins.models.llama.build_llama"


@dataclass(frozen=True)
class TensorParallelPlan:
    styles: Mapping[str, str]
    # Per-rank fix-ups after the split (the GPT's attention reads its per-rank head count).
    finish: Callable[[nn.Module, int], None] | None = None
    # Model-config checks: (field, what) pairs that tp must divide.
    divides: tuple[tuple[str, str], ...] = field(default_factory=tuple)

    @property
    def supports_sequence_parallel(self) -> bool:
        return "sequence_scatter" in self.styles.values()

    def style_of(self, module_name: str) -> str:
        for pattern, style in self.styles.items():
            if fnmatchcase(module_name, pattern):
                return style
        return "replicate"


def _gpt_heads_per_rank(model: nn.Module, tp: int) -> None:
    for block in model.blocks.values():
        block.attn.n_head //= tp


GPT_PLAN = TensorParallelPlan(
    styles={
        "embed": "sequence_scatter",
        "embed.tok": "vocab",
        "blocks.*.ln_1": "norm",
        "blocks.*.attn.qkv": "colwise_qkv",
        "blocks.*.attn.proj": "rowwise",
        "blocks.*.ln_2": "norm",
        "blocks.*.mlp.fc": "colwise",
        "blocks.*.mlp.proj": "rowwise",
        "norm": "norm",
        "head": "vocab",
    },
    finish=_gpt_heads_per_rank,
    divides=(("n_head", "attention heads"), ("vocab_size", "vocabulary")),
)

# Hugging Face names of LlamaForCausalLM (the same split as transformers' own base_model_tp_plan).
# q/k/v and gate/up are separate linears there, so each enters the region on its own.
LLAMA_PLAN = TensorParallelPlan(
    styles={
        "model.embed_tokens": "vocab",
        "model.layers.*.self_attn.q_proj": "colwise",
        "model.layers.*.self_attn.k_proj": "colwise",
        "model.layers.*.self_attn.v_proj": "colwise",
        "model.layers.*.self_attn.o_proj": "rowwise",
        "model.layers.*.mlp.gate_proj": "colwise",
        "model.layers.*.mlp.up_proj": "colwise",
        "model.layers.*.mlp.down_proj": "rowwise",
        "lm_head": "vocab",
    },
    divides=(("num_attention_heads", "attention heads"), ("num_key_value_heads", "KV heads"),
             ("hidden_size", "hidden size"), ("intermediate_size", "MLP size"),
             ("vocab_size", "vocabulary")),
)

BUILT_IN = {"gpt": GPT_PLAN, "llama": LLAMA_PLAN}
BY_TARGET = {GPT_TARGET: "gpt", LLAMA_TARGET: "llama"}


def plan_for(cfg) -> TensorParallelPlan | None:
    """The plan ``parallel.tp_plan`` names or gives, else the built-in one for ``model._target_``;
    None when there is none."""
    given: Any = cfg.parallel.get("tp_plan")
    if given is None:
        name = BY_TARGET.get(cfg.model._target_)
        return BUILT_IN[name] if name else None
    if isinstance(given, str):
        return BUILT_IN.get(given)
    return TensorParallelPlan(styles=dict(given))


def plan_problems(cfg, tp: int) -> list[str]:
    """Everything about the plan that can be checked before launch."""
    given = cfg.parallel.get("tp_plan")
    if isinstance(given, str) and given not in BUILT_IN:
        return [f"parallel.tp_plan={given}: choose one of {', '.join(BUILT_IN)} or give "
                "{module-pattern: style}"]
    plan = plan_for(cfg)
    if plan is None:
        return [f"parallel.tp={tp} but model._target_={cfg.model._target_} has no built-in "
                "tensor-parallel plan: give one as parallel.tp_plan={'<module pattern>': "
                f"<{'|'.join(STYLES)}>, ...}} or set parallel.tp=1"]
    problems = [f"parallel.tp_plan: {pattern!r} has style {style!r}; choose one of "
                f"{', '.join(STYLES)}" for pattern, style in plan.styles.items()
                if style not in STYLES]
    for key, what in plan.divides:
        value = cfg.model.get(key)
        if value is None or value % tp == 0:
            continue
        if key == "vocab_size":  # padded rows are never a target (GPT-2 pads 50257 to 50304)
            fix = f"pad it: model.{key}={-(-value // tp) * tp}"
        else:
            fix = f"choose tp in {[d for d in range(1, value + 1) if value % d == 0]}"
        problems.append(f"parallel.tp={tp} does not divide model.{key}={value} ({what}): {fix}")
    return problems


def apply_plan(model: nn.Module, plan: TensorParallelPlan, group, rank: int, size: int,
               sequence_parallel: bool) -> None:
    """Replace the planned modules of ``model`` by their tensor-parallel forms, in place."""
    from plait.plugins.tensor_parallel import layers as L
    from plait.plugins.tensor_parallel.mappings import scatter_to_sequence_parallel_region

    unused = set(plan.styles)
    memo: dict[int, nn.Parameter] = {}  # tied parameters are split once
    regions: dict[str, L.RegionEntry] = {}  # column-parallel siblings share one region entry
    for name, module in list(model.named_modules()):
        style = plan.style_of(name)
        unused -= {p for p in plan.styles if fnmatchcase(name, p)}
        if style == "replicate":
            continue
        if style == "sequence_scatter":
            if sequence_parallel:
                module.register_forward_hook(
                    lambda _m, _i, out: scatter_to_sequence_parallel_region(out, group))
            continue
        if style == "norm":
            if sequence_parallel:
                _expect(name, style, module, nn.LayerNorm)
                _replace(model, name, L.SequenceParallelLayerNorm.from_layer_norm(module, group))
            continue
        if style == "vocab" and isinstance(module, nn.Embedding):
            new = L.VocabParallelEmbedding(module, group, rank, size, memo)
        elif style in ("colwise", "colwise_qkv", "vocab"):
            _expect(name, style, module, nn.Linear)
            parent = name.rpartition(".")[0]
            region = regions.setdefault(parent, L.RegionEntry(group, sequence_parallel))
            new = L.ColumnParallelLinear(module, group, rank, size,
                                         parts=3 if style == "colwise_qkv" else 1,
                                         sequence_parallel=sequence_parallel, memo=memo,
                                         region=region)
            new.is_vocab_parallel_output = style == "vocab"
        else:
            _expect(name, style, module, nn.Linear)
            new = L.RowParallelLinear(module, group, rank, size, sequence_parallel, memo)
        _replace(model, name, new)
    if unused:
        raise ValueError(f"parallel.tp_plan patterns match no module of the model: "
                         f"{sorted(unused)}; module names look like "
                         f"{[n for n, _ in model.named_modules() if n][:6]}")
    if plan.finish is not None:
        plan.finish(model, size)


def _expect(name: str, style: str, module: nn.Module, kind: type) -> None:
    if not isinstance(module, kind):
        raise ValueError(f"parallel.tp_plan: {name} is a {type(module).__name__}, but style "
                         f"{style!r} needs an nn.{kind.__name__}")


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def shard_spec(plan: TensorParallelPlan, key: str) -> tuple[int, int] | None:
    """``(dim, parts)`` along which the state-dict entry ``key`` is split, or None (replicated)."""
    module_name, _, param = key.rpartition(".")
    style = plan.style_of(module_name)
    if style in ("colwise", "vocab"):
        return (0, 1)
    if style == "colwise_qkv":
        return (0, 3)
    if style == "rowwise" and param == "weight":
        return (1, 1)
    return None


def merge_shards(plan: TensorParallelPlan, shards: list[dict]) -> dict[str, torch.Tensor]:
    """Join ``shards[tp_rank]`` (state dicts of one pipeline stage) into the unsplit state dict."""
    from plait.plugins.tensor_parallel.layers import merge_tensors

    merged = {}
    for key, first in shards[0].items():
        spec = shard_spec(plan, key)
        merged[key] = first if spec is None else merge_tensors([s[key] for s in shards], *spec)
    return merged
