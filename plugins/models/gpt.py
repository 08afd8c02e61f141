"""A small GPT (pre-LayerNorm, causal self-attention through ``scaled_dot_product_attention``).

Packed documents: ``GPT(...)(idx, position_ids)`` with ``position_ids`` restarting at 0 where a
document starts (what ``data.pack=true`` gives) embeds each token at its position in its document
and masks attention across documents, so every document is computed as if it were alone.

Modules are named so that splitting plans read like Megatron's: ``blocks.<i>.attn.qkv`` (column
parallel), ``blocks.<i>.attn.proj`` (row parallel), ``blocks.<i>.mlp.fc`` / ``mlp.proj``,
``embed.tok`` (vocab parallel), ``head``. Blocks live in a ``ModuleDict`` keyed by layer index;
a pipeline stage replaces the parts it does not hold by identities (or None), so the same
``forward`` runs on each stage (torchtitan's pattern).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from plait import hookimpl
from plait.config import AT_LEAST_1, ModelConfig, Range, range_problems
from plait.meta import init_by_name
from plait.plugins.models.checks import context_problems, tensor_parallel_problems
from plait.types import PluginInfo


@dataclass
class GPTConfig(ModelConfig):
    _target_: str = "plait.plugins.models.gpt.GPT"
    vocab_size: int = 256
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0
    bias: bool = True
    tie_embeddings: bool = False


RANGES = {"vocab_size": AT_LEAST_1, "block_size": AT_LEAST_1, "n_layer": AT_LEAST_1,
          "n_head": AT_LEAST_1, "n_embd": AT_LEAST_1, "dropout": Range(0, 1, high_open=True)}


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """``[batch, seq]``: which document of its sequence each token is in (1, 2, ...), counting
    the starts (position 0) up to it."""
    return (position_ids == 0).cumsum(dim=-1)


def document_mask(documents: torch.Tensor) -> torch.Tensor:
    """``[batch, 1, seq, seq]`` bool: query ``i`` sees key ``j`` when ``j <= i`` and both are in
    the same document (a block-diagonal causal mask)."""
    seq = documents.shape[-1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=documents.device).tril()
    return (documents[:, :, None] == documents[:, None, :])[:, None] & causal


class CoreAttention(nn.Module):
    """``softmax(QKᵀ/√d + causal mask)·V`` over heads ``[batch, head, seq, head_dim]``: the part
    of attention without weights (Megatron's ``core_attention``), a module of its own so that
    selective activation checkpointing can recompute it alone, and context parallelism replace
    it. ``documents`` (``[batch, seq]``, packed documents): no query sees another document."""

    def __init__(self, dropout: float):
        super().__init__()
        self.dropout = dropout

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        dropout = self.dropout if self.training else 0.0
        if documents is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(documents),
                                              dropout_p=dropout)


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool):
        super().__init__()
        self.head_dim = n_embd // n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.core_attention = CoreAttention(dropout)
        self.proj = nn.Linear(n_embd, n_embd, bias=bias)

    def forward(self, x: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        # The heads on this rank follow from qkv's output width (a tensor-parallel split keeps
        # whole heads, fewer of them), and the sequence length from its shape: under sequence
        # parallelism x holds seq/tp positions and qkv gathers the whole sequence; under context
        # parallelism x holds seq/cp positions and the attention core exchanges keys and values.
        qkv = self.qkv(x)
        B, T, _ = qkv.shape
        q, k, v = qkv.view(B, T, 3, -1, self.head_dim).permute(2, 0, 3, 1, 4)
        y = self.core_attention(q, k, v, documents)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, n_embd: int, dropout: float, bias: bool):
        super().__init__()
        self.fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.proj = nn.Linear(4 * n_embd, n_embd, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, bias)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = MLP(n_embd, dropout, bias)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.resid_dropout(self.attn(self.ln_1(x), documents))
        return x + self.mlp(self.ln_2(x))


class Embedding(nn.Module):
    """Token plus learned position embeddings; ``position_ids`` (``[batch, seq]``) where the
    positions are not ``0 .. seq-1`` (packed documents, a context-parallel rank's tokens)."""

    def __init__(self, vocab_size: int, block_size: int, n_embd: int, dropout: float):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, n_embd)
        self.pos = nn.Embedding(block_size, n_embd)
        self.dropout = nn.Dropout(dropout)

    def forward(self, idx: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if position_ids is None:
            position_ids = torch.arange(idx.size(1), device=idx.device)
        return self.dropout(self.tok(idx) + self.pos(position_ids))


class GPT(nn.Module):
    """``GPT(...)(idx) -> logits``, idx ``[batch, seq]`` token ids, logits ``[batch, seq, vocab]``;
    ``GPT(...)(idx, position_ids)`` for packed documents."""

    # Megatron's split (see plait.plugins.tensor_parallel.plan): attention and MLP as
    # column- then row-parallel pairs, the fused QKV weight split per q/k/v so every rank holds
    # whole heads, embedding and head over the vocabulary.
    tensor_parallel_plan = {
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
    }
    # Pipeline stages (plait.plugins.pipeline.split): the embedding on the first stage, runs of
    # blocks, the final norm and head on the last.
    pipeline_plan = {"first": ["embed"], "layers": "blocks", "last": ["norm", "head"]}
    # What each train.activation_checkpointing mode recomputes (module-name patterns): every
    # block, or only the attention core (Korthikanti et al. 2022, "selective").
    activation_checkpointing_plan = {"full": "blocks.*",
                                     "selective": "blocks.*.attn.core_attention"}
    # Context parallelism (plait.plugins.context_parallel.apply): the embedding takes the token
    # ids and is given the positions of this rank's tokens; the attention cores are replaced.
    context_parallel_plan = {"embed": "sequence_split",
                             "blocks.*.attn.core_attention": "attention"}

    def __init__(self, vocab_size: int = 256, block_size: int = 64, n_layer: int = 2,
                 n_head: int = 4, n_embd: int = 64, dropout: float = 0.0, bias: bool = True,
                 tie_embeddings: bool = False):
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"model.n_embd={n_embd} is not divisible by model.n_head={n_head}")
        self.block_size = block_size
        self.n_layer, self.n_head, self.n_embd = n_layer, n_head, n_embd
        self.embed = Embedding(vocab_size, block_size, n_embd, dropout)
        self.blocks = nn.ModuleDict(
            {str(i): Block(n_embd, n_head, dropout, bias) for i in range(n_layer)}
        )
        self.norm = nn.LayerNorm(n_embd, bias=bias)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        if tie_embeddings:
            self.head.weight = self.embed.tok.weight
        init_by_name(self, torch.initial_seed())  # the seed last set: plait seeds it with `seed`

    def init_parameter(self, name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        """GPT-2's initial value of the unsplit parameter ``name``, written into ``tensor`` from
        ``generator`` (one per parameter, :mod:`plait.meta`): weights of linears and embeddings
        ``N(0, 0.02)``, residual projections ``N(0, 0.02/√(2L))``, biases 0, LayerNorm gains 1.
        Decided by the name alone, so any rank can make any parameter whatever it holds."""
        module, _, kind = name.rpartition(".")
        leaf = module.rpartition(".")[2]
        if leaf.startswith("ln_") or leaf == "norm":
            tensor.fill_(1.0 if kind == "weight" else 0.0)
        elif kind == "bias":
            tensor.zero_()
        else:
            std = 0.02 / math.sqrt(2 * self.n_layer) if leaf == "proj" else 0.02
            tensor.normal_(mean=0.0, std=std, generator=generator)

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: ``6·N`` for the weight matmuls (forward and backward) plus
        ``12·L·E·T`` for attention's score and value matmuls over ``T`` positions (PaLM, appendix
        B; ``E`` = heads × head size). Position embeddings are a lookup, not a matmul."""
        n = sum(p.numel() for p in self.parameters()) - self.embed.pos.weight.numel()
        return 6 * n + 12 * self.n_layer * self.n_embd * seq_len

    def activation_bytes(self, batch_size: int, seq_len: int, bytes_per_value: int,
                         recompute: str = "none") -> int:
        """Bytes one forward of ``batch_size`` sequences saves for backward, values in
        ``bytes_per_value`` bytes (the model's dtype), without dropout (the default).

        Korthikanti et al. 2022 (sec. 4.1) count ``34·s·b·h + 5·a·s²·b`` bytes per layer at 16
        bits; here attention is fused (``scaled_dot_product_attention`` keeps q, k, v, its
        output and an fp32 log-sum-exp of ``a·s·b``, no ``s²`` scores) and there are no dropout
        masks, which leaves 16 values of ``s·b·h`` per layer: the two LayerNorm inputs and
        outputs, q/k/v, the attention output, the MLP's GELU input and output (``4h`` each),
        plus each LayerNorm's mean and rstd (``2·s·b``). After the layers: the final norm's
        input, output, mean and rstd, the token ids and positions (int64), and the loss's fp32
        log-softmax over the vocabulary (``s·b·V``) with its targets.

        With ``recompute`` (``train.activation_checkpointing``): ``selective`` recomputes the
        attention core, whose inputs q, k, v the checkpoint keeps and whose output the
        projection saves, so only the log-sum-exp goes; ``full`` keeps each block's input,
        ``s·b·h``. Full recompute holds one block's activations again while that block's
        backward runs; that transient is not counted here.
        """
        s, b, h, a = seq_len, batch_size, self.n_embd, self.n_head
        v, fp32, int64 = bytes_per_value, 4, 8
        per_layer = {
            "none": (16 * s * b * h + 2 * 2 * s * b) * v + a * s * b * fp32,
            "selective": (16 * s * b * h + 2 * 2 * s * b) * v,
            "full": s * b * h * v,
        }[recompute]
        tail = (2 * s * b * h + 2 * s * b) * v + s * b * self.head.out_features * fp32
        ids = (2 * s * b + s) * int64  # inputs, targets, positions
        return self.n_layer * per_layer + tail + ids

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        # A pipeline stage after the first gets hidden states as x and the batch's position_ids.
        documents = None if position_ids is None else document_ids(position_ids)
        if self.embed is not None:
            x = self.embed(x, position_ids)
        for block in self.blocks.values():
            x = block(x, documents)
        if self.norm is not None:
            x = self.norm(x)
        if self.head is not None:
            x = self.head(x)
        return x


@hookimpl
def plait_declare() -> PluginInfo:
    return PluginInfo(
        name="gpt", selected_by={"model._target_": GPTConfig._target_},
        provides=frozenset({"model:tensor_parallel_plan", "model:activation_checkpointing_plan",
                            "model:context_parallel"}),
        description="plait's GPT: schema, checks, and what it lets split")


@hookimpl
def plait_register_configs(config_store) -> None:
    config_store.store(group="model", name="base_gpt", node=GPTConfig)


@hookimpl
def plait_validate(cfg, dims) -> list[str]:
    m = cfg.model
    problems = range_problems("model", m, RANGES)
    if problems:
        return problems
    problems = context_problems(cfg, m.block_size)
    if m.n_embd % m.n_head:
        problems.append(f"model.n_embd={m.n_embd} is not divisible by model.n_head={m.n_head}: "
                        "choose n_embd as a multiple of n_head")
    if dims.cp > 1 and m.dropout > 0:
        problems.append(f"model.dropout={m.dropout} with parallel.cp={dims.cp}: the attention "
                        "of context-parallel ranks has no dropout on its probabilities: set "
                        "model.dropout=0 or parallel.cp=1")
    return problems + tensor_parallel_problems(
        cfg, dims.tp, {"n_head": "attention heads", "vocab_size": "vocabulary"})
