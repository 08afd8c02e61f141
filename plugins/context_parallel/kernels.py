"""Attention over one tile (a chunk of queries against a chunk of keys) with its log-sum-exp, and
the tile's backward given the merged output and log-sum-exp of all tiles.

For queries ``q`` (``[b, heads, m, d]``) and keys, values ``k``, ``v`` (``[b, heads, n, d]``)::

    S = q·kᵀ·scale + mask          lse = log Σ_j exp(S_j)          out = softmax(S)·v

A row that the mask hides completely has ``lse = -inf`` and ``out = 0`` (it adds nothing when
merged). The backward of one tile, given the *merged* ``out`` and ``lse`` of every tile its
queries saw (flash attention's backward, as ring attention uses it)::

    P = exp(S - lse)   dv = Pᵀ·dout   dP = dout·vᵀ   dS = P ∘ (dP - rowsum(dout ∘ out))
    dq = dS·k·scale    dk = dSᵀ·q·scale

On the CPU both are ATen's fused flash-attention kernels for the CPU
(``_scaled_dot_product_flash_attention_for_cpu`` and its backward, what
``scaled_dot_product_attention`` runs there): blocked, no ``m x n`` score matrix kept. On other
devices the same formulas in plain tensor operations (the tile's scores are materialised).
``mask`` is ``causal`` (query ``i`` sees keys ``0..i``, a square tile) and/or an additive
``bias`` (``0`` or ``-inf``, ``[b, 1, m, n]``).
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Partial results and log-sum-exps are kept in fp32 (fp64 for fp64 inputs)."""
    return torch.promote_types(dtype, torch.float32)


def tile_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    bias: torch.Tensor | None,
    visible_rows: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of one tile; ``lse`` ``[b, heads, m]`` in the accumulation dtype.
    ``visible_rows`` (``[b, m]`` bool, with ``bias``): rows that see at least one key."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=None if bias is None else bias.to(q.dtype), scale=scale
        )
        lse = lse.to(accumulation_dtype(q.dtype))
    else:
        scores = scores_of(q, k, causal, bias, scale)
        lse = scores.logsumexp(-1)
        probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num_(0.0)
        out = (probs @ v.to(probs.dtype)).to(q.dtype)
    if visible_rows is not None:  # the CPU kernel gives a hidden row lse 0, not -inf
        lse = lse.masked_fill(~visible_rows[:, None, :], NEG_INF)
    return out, lse


def tile_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    bias: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of one tile, ``out`` and ``lse`` the merged ones of its query rows."""
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout,
            q,
            k,
            v,
            out.to(q.dtype),
            lse.to(accumulation_dtype(q.dtype)),
            0.0,
            causal,
            attn_mask=None if bias is None else bias.to(q.dtype),
            scale=scale,
        )
    acc = accumulation_dtype(q.dtype)
    probs = torch.exp(scores_of(q, k, causal, bias, scale) - lse.unsqueeze(-1))
    dout_, out_ = dout.to(acc), out.to(acc)
    dv = probs.transpose(-1, -2) @ dout_
    dprobs = dout_ @ v.to(acc).transpose(-1, -2)
    dscores = probs * (dprobs - (dout_ * out_).sum(-1, keepdim=True))
    dq = dscores @ k.to(acc) * scale
    dk = dscores.transpose(-1, -2) @ q.to(acc) * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def scores_of(
    q: torch.Tensor, k: torch.Tensor, causal: bool, bias: torch.Tensor | None, scale: float
) -> torch.Tensor:
    acc = accumulation_dtype(q.dtype)
    scores = (q.to(acc) @ k.to(acc).transpose(-1, -2)) * scale
    if causal:
        m, n = scores.shape[-2:]
        hidden = torch.ones(m, n, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(hidden, NEG_INF)
    if bias is not None:
        scores = scores + bias.to(acc)
    return scores


def merge(
    out: torch.Tensor | None,
    lse: torch.Tensor | None,
    tile_out: torch.Tensor,
    tile_lse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial softmax results over disjoint keys, as one (fp32)::

        lse = log(e^lse₁ + e^lse₂)     out = out₁·e^(lse₁ - lse) + out₂·e^(lse₂ - lse)

    A row hidden from both stays ``out = 0``, ``lse = -inf``."""
    tile_out = tile_out.to(tile_lse.dtype)
    if out is None:
        return tile_out, tile_lse
    merged = torch.logaddexp(lse, tile_lse)
    seen = (merged > NEG_INF).unsqueeze(-1)
    old = torch.where(seen, torch.exp(lse - merged).unsqueeze(-1), 0.0)
    new = torch.where(seen, torch.exp(tile_lse - merged).unsqueeze(-1), 0.0)
    return out * old + tile_out * new, merged
