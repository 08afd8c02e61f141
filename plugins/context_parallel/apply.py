"""Make a model context-parallel in place, by its ``context_parallel_plan``.

The plan maps module-name patterns (``fnmatch``) to what plait does to the module:

==================  =========================================================================
``sequence_split``  the module that takes the token ids, ``forward(ids, position_ids=None)``
                    (plait's GPT: ``embed``) or, called with keywords, ``forward(input_ids=None,
                    position_ids=None, inputs_embeds=None, ...)`` (a ``transformers`` base
                    model): its input ids are cut to this rank's tokens before it runs, and it
                    is given their positions in the sequence (or, with packed documents, in
                    their documents) as ``position_ids``; everything after it holds ``T/C``
                    tokens per sequence. Given ``inputs_embeds`` (a later pipeline stage) it
                    only gets the positions: the hidden states are this rank's already
``attention``       the attention core, ``forward(q, k, v, documents=None)`` over
                    ``[b, heads, seq, d]`` computing ``softmax(q·kᵀ·scale + causal mask [+
                    document mask])·v``, ``scale`` its attribute ``scale`` or ``1/√d`` (plait's
                    GPT: ``blocks.*.attn.core_attention``), ``k`` and ``v`` with as many heads as
                    ``q`` or fewer (grouped-query attention, each serving ``H / h_kv`` query
                    heads): replaced by :class:`ContextParallelAttention`, which exchanges keys
                    and values
==================  =========================================================================

Like Megatron-core (``get_batch_on_this_cp_rank``) every context-parallel rank receives the whole
batch from the loader (token ids are small) and keeps its own chunks; the loss cuts the targets
the same way (:class:`SequenceShardLoss`). Each rank's loss is the mean over its tokens; all
ranks hold equally many, so the mean over the ``dp x cp`` ranks is the batch's mean, and
gradients averaged over them (the engine's ``dp x cp`` reduction) are the batch's gradients.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Callable

import torch
import torch.nn as nn

from plait.plugins.context_parallel.layout import SequenceLayout
from plait.plugins.context_parallel.ring import ExchangeStats, RingAttention, expand_heads
from plait.plugins.context_parallel.ulysses import ulysses_attention

BACKENDS = ("ring", "ulysses")
STYLES = ("sequence_split", "attention")


def layout_for(backend: str, seq_len: int, size: int, rank: int) -> SequenceLayout:
    """Zigzag chunks for ring attention (load balance), contiguous ones for Ulysses."""
    if backend == "ring":
        return SequenceLayout.zigzag(seq_len, size, rank)
    return SequenceLayout.contiguous(seq_len, size, rank)


class ContextParallelAttention(nn.Module):
    """The model's attention core over this rank's tokens, attending to every rank's keys:
    ring attention (:mod:`.ring`) or Ulysses (:mod:`.ulysses`, which runs ``inner`` itself)."""

    def __init__(
        self, inner: nn.Module, backend: str, layout: SequenceLayout, group, stats: ExchangeStats
    ):
        super().__init__()
        self.inner, self.backend, self.layout = inner, backend, layout
        self.group, self.stats = group, stats

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        documents: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self.backend == "ulysses":
            if k.shape[1] % self.layout.size:  # too few key/value heads to share out: repeat
                groups = q.shape[1] // k.shape[1]
                k, v = expand_heads(k, groups), expand_heads(v, groups)
            return ulysses_attention(self.inner, q, k, v, documents, self.group, self.stats)
        scale = getattr(self.inner, "scale", None)
        if scale is None:
            scale = q.shape[-1] ** -0.5  # scaled_dot_product_attention's default
        return RingAttention.apply(q, k, v, documents, self.layout, self.group, scale, self.stats)


def split_sequence(layout: SequenceLayout) -> Callable:
    """A forward pre-hook: ``(ids, position_ids)`` → this rank's ids and their positions; called
    with keywords, ``input_ids`` and ``position_ids`` likewise (``inputs_embeds``: positions
    only), also when only the ids come by position."""

    def positions_of(positions, like: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        if positions is None:
            return index.expand(like.shape[0], -1)
        return positions[:, index]

    def hook(module, args, kwargs):
        if len(args) == 1 and kwargs:  # a transformers base model given its ids by position
            args, kwargs = (), {"input_ids": args[0], **kwargs}  # (GPT-NeoX's *ForCausalLM)
        if args:
            ids, *rest = args
            positions = rest[0] if rest else kwargs.pop("position_ids", None)
            index = layout.index(device=ids.device)
            return (ids[:, index], positions_of(positions, ids, index)), kwargs
        ids, embeds = kwargs.get("input_ids"), kwargs.get("inputs_embeds")
        like = ids if ids is not None else embeds
        index = layout.index(device=like.device)
        if ids is not None:
            kwargs["input_ids"] = ids[:, index]
        kwargs["position_ids"] = positions_of(kwargs.get("position_ids"), like, index)
        return args, kwargs

    return hook


def planned(model: nn.Module, plan: dict[str, str], style: str) -> list[str]:
    return [
        name
        for name, _ in model.named_modules()
        if any(fnmatchcase(name, p) for p, s in plan.items() if s == style)
    ]


def apply_context_parallel(
    model: nn.Module, backend: str, layout: SequenceLayout, group, stats: ExchangeStats
) -> list[str]:
    """Cut the model's input and replace its attention cores; return the modules replaced."""
    plan = model.context_parallel_plan
    for name in planned(model, plan, "sequence_split"):
        model.get_submodule(name).register_forward_pre_hook(
            split_sequence(layout), with_kwargs=True
        )
    replaced = planned(model, plan, "attention")
    for name in replaced:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(
            parent,
            child,
            ContextParallelAttention(getattr(parent, child), backend, layout, group, stats),
        )
    return replaced


class SequenceShardLoss:
    """``loss_fn(logits, targets)`` with the targets cut to this rank's tokens: ``logits`` are
    ``[b, T/C, vocab]`` (this rank's), ``targets`` ``[b, T]`` (the whole batch's)."""

    def __init__(self, loss_fn: Callable, layout: SequenceLayout):
        self.loss_fn, self.layout = loss_fn, layout

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(logits, targets[:, self.layout.index(device=targets.device)])


def exchange_bytes(
    backend: str,
    seq_len: int,
    batch_size: int,
    width: int,
    cp: int,
    bytes_per_value: int,
    kv_width: int | None = None,
) -> float:
    """Bytes one rank's attention sends for one layer, forward and backward, for ``batch_size``
    sequences of ``seq_len`` tokens with queries ``width`` wide on this rank (hidden size, over
    ``tp``) and keys/values ``kv_width`` (``width`` unless grouped-query attention has fewer
    key/value heads; Ulysses repeats them to ``width`` when ``cp`` does not divide them). With
    ``n = seq_len/cp`` tokens per rank, ``u = n·b·bytes`` and ``kv = 2·u·kv_width`` one rank's
    keys and values::

        ring:     (C - 1)·kv forward, (C - 1)·kv + C·kv backward      = (3C - 2)·kv
        ulysses:  4 all-to-alls forward (q, k, v, out) and 4 backward, each sending
                  (C - 1)/C of what it holds             = 4·(C - 1)/C·u·(width + kv_width)
    """
    kv_width = width if kv_width is None else kv_width
    unit = seq_len // cp * batch_size * bytes_per_value
    if cp == 1:
        return 0.0
    if backend == "ring":
        return (3 * cp - 2) * 2 * unit * kv_width
    return 4 * (cp - 1) / cp * unit * (width + kv_width)
