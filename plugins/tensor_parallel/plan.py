"""Tensor-parallel plans: which submodule is split how (torchtitan's declarative plan).

A plan maps module-name patterns (``fnmatch``: ``blocks.*.attn.qkv``) to a *style*; the first
matching pattern wins, unmatched modules are replicated. Styles:

===================  ==========================================================================
``colwise``          ``nn.Linear`` → :class:`ColumnParallelLinear` (output features split)
``colwise_qkv``      the same for a fused ``[q; k; v]`` weight: each third split, whole heads
``colwise_gather_output``  column-parallel, the output all-gathered (Megatron's
                     ``gather_output``; transformers' name): for a module that slices its fused
                     output by the full widths (Phi-3's ``qkv_proj``, ``gate_up_proj``)
``rowwise``          ``nn.Linear`` → :class:`RowParallelLinear` (input features split)
``rowwise_split_input``  row-parallel on a whole input, each rank keeping its slice first
                     (Megatron's ``input_is_parallel=False``; transformers' name)
``vocab``            ``nn.Embedding`` → :class:`VocabParallelEmbedding`; on the output
                     ``nn.Linear``: column-parallel over the vocabulary, logits stay split and
                     the loss is the vocab-parallel cross-entropy
``norm``             ``nn.LayerNorm`` inside the sequence-parallel region (only matters with
                     ``tensor_parallel.sequence_parallel``)
``sequence_scatter`` the module whose output enters the sequence-parallel region (its output is
                     split along the sequence under ``tensor_parallel.sequence_parallel``)
``mla_kv_a_proj``    multi-head latent attention's key/value down-projection (MiniCPM3,
                     DeepSeek-V2; transformers' name): kept whole, and the gradient of its last
                     ``qk_rope_head_dim`` output features (the rotary key every rank's heads use
                     directly, not through a column-parallel layer) summed over the group
``replicate``        kept whole on every rank (overrides a later, broader pattern)
===================  ==========================================================================

The model declares its own plan, as ``transformers`` models carry ``base_model_tp_plan`` and
torchtitan's models their ``parallelize`` function: the attribute ``tensor_parallel_plan`` of the
model (plait's GPT and Llama have one; their plugins declare ``model:tensor_parallel_plan``).
``tensor_parallel.plan`` in the config replaces it. The same table decides how a checkpoint's
shards merge back (:func:`merge_shards`), so the split and the merge cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any, Mapping

import torch
import torch.nn as nn

STYLES = (
    "colwise",
    "colwise_qkv",
    "colwise_gather_output",
    "rowwise",
    "rowwise_split_input",
    "vocab",
    "norm",
    "sequence_scatter",
    "mla_kv_a_proj",
    "replicate",
)
COLUMN_STYLES = ("colwise", "colwise_qkv", "colwise_gather_output", "vocab")
ROW_STYLES = ("rowwise", "rowwise_split_input")


@dataclass(frozen=True)
class TensorParallelPlan:
    styles: Mapping[str, str]

    @property
    def supports_sequence_parallel(self) -> bool:
        return "sequence_scatter" in self.styles.values()

    def style_of(self, module_name: str) -> str:
        for pattern, style in self.styles.items():
            if fnmatchcase(module_name, pattern):
                return style
        return "replicate"

    def unmatched_patterns(self, model: nn.Module) -> list[str]:
        names = [name for name, _ in model.named_modules()]
        return sorted(p for p in self.styles if not any(fnmatchcase(n, p) for n in names))


def plan_for(cfg, model: nn.Module) -> TensorParallelPlan | None:
    """``tensor_parallel.plan`` when given, else the model's own ``tensor_parallel_plan``; None
    when there is neither."""
    given: Any = cfg.tensor_parallel.plan
    styles = given if given is not None else getattr(model, "tensor_parallel_plan", None)
    return TensorParallelPlan(styles=dict(styles)) if styles is not None else None


def plan_problems(cfg, model: nn.Module) -> list[str]:
    """Everything about the plan that can be checked before launch, on the model built on the
    meta device."""
    plan = plan_for(cfg, model)
    if plan is None:
        return []  # the capability check names the missing model:tensor_parallel_plan
    problems = [
        f"tensor_parallel.plan: {pattern!r} has style {style!r}; choose one of {', '.join(STYLES)}"
        for pattern, style in plan.styles.items()
        if style not in STYLES
    ]
    problems += [
        f"tensor_parallel.plan gives {name} the style 'mla_kv_a_proj', which needs the width of "
        "its rotary key (the module's qk_rope_head_dim, which model=hf sets): give it one or "
        "another style"
        for name, module in model.named_modules()
        if plan.style_of(name) == "mla_kv_a_proj" and not hasattr(module, "qk_rope_head_dim")
    ]
    unmatched = plan.unmatched_patterns(model)
    if unmatched:
        problems.append(
            f"tensor_parallel.plan patterns match no module of the model: "
            f"{unmatched}; module names look like "
            f"{[n for n, _ in model.named_modules() if n][:6]}"
        )
    return problems


def apply_plan(
    model: nn.Module, plan: TensorParallelPlan, group, rank: int, size: int, sequence_parallel: bool
) -> None:
    """Replace the planned modules of ``model`` by their tensor-parallel forms, in place."""
    from plait.plugins.tensor_parallel import layers as L
    from plait.plugins.tensor_parallel.mappings import scatter_to_sequence_parallel_region

    memo: dict[int, nn.Parameter] = {}  # tied parameters are split once
    regions: dict[str, L.RegionEntry] = {}  # column-parallel siblings share one region entry
    for name, module in list(model.named_modules()):
        style = plan.style_of(name)
        if style == "replicate":
            continue
        if style == "sequence_scatter":
            if sequence_parallel:
                module.register_forward_hook(
                    lambda _m, _i, out: scatter_to_sequence_parallel_region(out, group)
                )
            continue
        if style == "mla_kv_a_proj":
            _expect(name, style, module, nn.Linear)
            module.register_forward_hook(L.SharedRotaryKey(group, module.qk_rope_head_dim))
            continue
        if style == "norm":
            if sequence_parallel:
                _expect(name, style, module, nn.LayerNorm)
                _replace(model, name, L.SequenceParallelLayerNorm.from_layer_norm(module, group))
            continue
        if style == "vocab" and isinstance(module, nn.Embedding):
            new = L.vocab_parallel_embedding(module, group, rank, size, memo)
        elif style in COLUMN_STYLES:
            _expect(name, style, module, nn.Linear)
            parent = name.rpartition(".")[0]
            region = regions.setdefault(parent, L.RegionEntry(group, sequence_parallel))
            new = L.ColumnParallelLinear(
                module,
                group,
                rank,
                size,
                parts=3 if style == "colwise_qkv" else 1,
                sequence_parallel=sequence_parallel,
                memo=memo,
                region=region,
                gather_output=style == "colwise_gather_output",
            )
            new.is_vocab_parallel_output = style == "vocab"
        else:
            _expect(name, style, module, nn.Linear)
            new = L.RowParallelLinear(
                module,
                group,
                rank,
                size,
                sequence_parallel,
                memo,
                input_is_parallel=style == "rowwise",
            )
        _replace(model, name, new)


def _expect(name: str, style: str, module: nn.Module, kind: type) -> None:
    if not isinstance(module, kind):
        raise ValueError(
            f"tensor_parallel.plan: {name} is a {type(module).__name__}, but style "
            f"{style!r} needs an nn.{kind.__name__}"
        )


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def shard_spec(plan: TensorParallelPlan, key: str) -> tuple[int, int] | None:
    """``(dim, parts)`` along which the state-dict entry ``key`` is split, or None (replicated)."""
    module_name, _, param = key.rpartition(".")
    style = plan.style_of(module_name)
    if style in ("colwise", "colwise_gather_output", "vocab"):
        return (0, 1)
    if style == "colwise_qkv":
        return (0, 3)
    if style in ROW_STYLES and param == "weight":
        return (1, 1)
    return None


def merge_shards(plan: TensorParallelPlan, shards: list[dict]) -> dict[str, torch.Tensor]:
    """Join ``shards[tp_rank]`` (state dicts of one pipeline stage) into the unsplit state dict."""
    from plait.engine.tensor_shards import merge_tensors

    merged = {}
    for key, first in shards[0].items():
        spec = shard_spec(plan, key)
        merged[key] = first if spec is None else merge_tensors([s[key] for s in shards], *spec)
    return merged
