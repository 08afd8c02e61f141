"""A small GPT (pre-LayerNorm, causal self-attention through ``scaled_dot_product_attention``).

Modules are named so that splitting plans read like Megatron's: ``blocks.<i>.attn.qkv`` (column
parallel), ``blocks.<i>.attn.proj`` (row parallel), ``blocks.<i>.mlp.fc`` / ``mlp.proj``,
``embed.tok`` (vocab parallel), ``head``. Blocks live in a ``ModuleDict`` keyed by layer index and
every part may be set to None, so a pipeline stage keeps only its share and the same ``forward``
runs on each stage (torchtitan's pattern).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from plait import hookimpl
from plait.config import ModelConfig
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


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool):
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # n_head is the number of heads on this rank: a tensor-parallel split lowers it. The
        # shape is read from qkv's output: under sequence parallelism x holds seq/tp positions
        # and qkv gathers the whole sequence.
        qkv = self.qkv(x)
        B, T, _ = qkv.shape
        q, k, v = qkv.view(B, T, 3, self.n_head, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.resid_dropout(self.attn(self.ln_1(x)))
        return x + self.mlp(self.ln_2(x))


class Embedding(nn.Module):
    """Token plus learned position embeddings."""

    def __init__(self, vocab_size: int, block_size: int, n_embd: int, dropout: float):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, n_embd)
        self.pos = nn.Embedding(block_size, n_embd)
        self.dropout = nn.Dropout(dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.size(1), device=idx.device)
        return self.dropout(self.tok(idx) + self.pos(positions))


class GPT(nn.Module):
    """``GPT(...)(idx) -> logits``, idx ``[batch, seq]`` token ids, logits ``[batch, seq, vocab]``."""

    def __init__(self, vocab_size: int = 256, block_size: int = 64, n_layer: int = 2,
                 n_head: int = 4, n_embd: int = 64, dropout: float = 0.0, bias: bool = True,
                 tie_embeddings: bool = False):
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"model.n_embd={n_embd} is not divisible by model.n_head={n_head}")
        self.block_size = block_size
        self.embed = Embedding(vocab_size, block_size, n_embd, dropout)
        self.blocks = nn.ModuleDict(
            {str(i): Block(n_embd, n_head, dropout, bias) for i in range(n_layer)}
        )
        self.norm = nn.LayerNorm(n_embd, bias=bias)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        if tie_embeddings:
            self.head.weight = self.embed.tok.weight
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):  # GPT-2's scaled init of residual projections
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks.values():
            x = block(x)
        if self.norm is not None:
            x = self.norm(x)
        if self.head is not None:
            x = self.head(x)
        return x


@hookimpl
def plait_declare() -> PluginInfo:
    return PluginInfo(name="gpt", description="the GPT model's config schema and checks")


@hookimpl
def plait_register_configs(config_store) -> None:
    config_store.store(group="model", name="base_gpt", node=GPTConfig)


@hookimpl
def plait_validate(cfg) -> list[str]:
    m = cfg.model
    if m._target_ != GPTConfig._target_ or m.n_embd % m.n_head == 0:
        return []
    return [f"model.n_embd={m.n_embd} is not divisible by model.n_head={m.n_head}: choose "
            "n_embd as a multiple of n_head"]
