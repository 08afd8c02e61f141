"""A small GPT (pre-LayerNorm, causal self-attention through ``scaled_dot_product_attention``).

Packed documents: ``GPT(...)(idx, position_ids)`` with ``position_ids`` restarting at 0 where a
document starts (what ``data.pack=true`` gives) embeds each token at its position in its document
and masks attention across documents, so every document is computed as if it were alone.

Modules are named so that splitting plans read like Megatron's: ``blocks.<i>.attn.qkv`` (column
parallel), ``blocks.<i>.attn.proj`` (row parallel), ``blocks.<i>.mlp.fc`` / ``mlp.proj``,
``embed.tok`` (vocab parallel), ``head``. With ``model.n_experts=E`` every ``model.moe_every``-th
block's MLP is a mixture of experts (:mod:`.moe`): ``blocks.<i>.mlp.router``,
``blocks.<i>.mlp.experts.<e>.fc``/``proj``, ``blocks.<i>.mlp.shared.*``. Blocks live in a
``ModuleDict`` keyed by layer index; a pipeline stage replaces the parts it does not hold by
identities (or None), so the same ``forward`` runs on each stage (torchtitan's pattern).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from plait import hookimpl
from plait.config import AT_LEAST_0, AT_LEAST_1, POSITIVE, ModelConfig, Range, range_problems
from plait.meta import init_by_name
from plait.plugins.models.checks import context_problems, tensor_parallel_problems
from plait.plugins.models.moe import ROUTERS, MoE
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
    # Mixture of experts (moe.py): 0 experts keeps every block's dense MLP.
    n_experts: int = 0
    top_k: int = 2  # experts each token is routed to
    moe_every: int = 1  # block i is MoE when i % moe_every == 0 (Megatron's moe_layer_freq)
    shared_expert: bool = False  # one more expert every token goes through
    router: str = "softmax"  # softmax | sigmoid (DeepSeek-V3)
    aux_loss_coeff: float = 0.01  # load-balancing loss weight (Switch Transformer)
    z_loss_coeff: float = 0.001  # router z-loss weight (ST-MoE)
    capacity_factor: Optional[float] = None  # None: dropless; c: each expert takes c·T·k/E
    expert_hidden: Optional[int] = None  # an expert's MLP width; None: 4 x n_embd


RANGES = {
    "vocab_size": AT_LEAST_1,
    "block_size": AT_LEAST_1,
    "n_layer": AT_LEAST_1,
    "n_head": AT_LEAST_1,
    "n_embd": AT_LEAST_1,
    "dropout": Range(0, 1, high_open=True),
    "n_experts": Range(0, meaning="0: dense MLPs"),
    "top_k": AT_LEAST_1,
    "moe_every": AT_LEAST_1,
    "aux_loss_coeff": AT_LEAST_0,
    "z_loss_coeff": AT_LEAST_0,
    "capacity_factor": POSITIVE,
    "expert_hidden": AT_LEAST_1,
}


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

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        documents: torch.Tensor | None = None,
    ) -> torch.Tensor:
        dropout = self.dropout if self.training else 0.0
        if documents is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=document_mask(documents), dropout_p=dropout
        )


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
    def __init__(self, n_embd: int, dropout: float, bias: bool, hidden: int | None = None):
        super().__init__()
        hidden = hidden or 4 * n_embd
        self.fc = nn.Linear(n_embd, hidden, bias=bias)
        self.proj = nn.Linear(hidden, n_embd, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(
        self, n_embd: int, n_head: int, dropout: float, bias: bool, mlp: nn.Module | None = None
    ):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, bias)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = mlp if mlp is not None else MLP(n_embd, dropout, bias)
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
    # A mixture-of-experts block splits each expert as the dense MLP (Megatron's expert tensor
    # parallelism equal to tp); the router stays whole on every tensor-parallel rank.
    moe_tensor_parallel_plan = {
        "blocks.*.mlp.experts.*.fc": "colwise",
        "blocks.*.mlp.experts.*.proj": "rowwise",
        "blocks.*.mlp.shared.fc": "colwise",
        "blocks.*.mlp.shared.proj": "rowwise",
    }
    # Pipeline stages (plait.plugins.pipeline.split): the embedding on the first stage, runs of
    # blocks, the final norm and head on the last.
    pipeline_plan = {"first": ["embed"], "layers": "blocks", "last": ["norm", "head"]}
    # What each train.activation_checkpointing mode recomputes (module-name patterns): every
    # block, or only the attention core (Korthikanti et al. 2022, "selective").
    activation_checkpointing_plan = {
        "full": "blocks.*",
        "selective": "blocks.*.attn.core_attention",
    }
    # Context parallelism (plait.plugins.context_parallel.apply): the embedding takes the token
    # ids and is given the positions of this rank's tokens; the attention cores are replaced.
    context_parallel_plan = {"embed": "sequence_split", "blocks.*.attn.core_attention": "attention"}

    def __init__(
        self,
        vocab_size: int = 256,
        block_size: int = 64,
        n_layer: int = 2,
        n_head: int = 4,
        n_embd: int = 64,
        dropout: float = 0.0,
        bias: bool = True,
        tie_embeddings: bool = False,
        n_experts: int = 0,
        top_k: int = 2,
        moe_every: int = 1,
        shared_expert: bool = False,
        router: str = "softmax",
        aux_loss_coeff: float = 0.01,
        z_loss_coeff: float = 0.001,
        capacity_factor: float | None = None,
        expert_hidden: int | None = None,
    ):
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"model.n_embd={n_embd} is not divisible by model.n_head={n_head}")
        self.block_size = block_size
        self.n_layer, self.n_head, self.n_embd = n_layer, n_head, n_embd
        self.n_experts, self.top_k = n_experts, top_k
        self.embed = Embedding(vocab_size, block_size, n_embd, dropout)

        def mlp(i: int) -> nn.Module | None:
            if not n_experts or i % moe_every:
                return None
            return MoE(
                n_embd,
                n_experts,
                top_k,
                lambda: MLP(n_embd, dropout, bias, expert_hidden),
                shared_expert,
                router,
                aux_loss_coeff,
                z_loss_coeff,
                capacity_factor,
                layer_index=i,
            )

        self.blocks = nn.ModuleDict(
            {str(i): Block(n_embd, n_head, dropout, bias, mlp(i)) for i in range(n_layer)}
        )
        if n_experts:
            dense = any(i % moe_every for i in range(n_layer))
            styles = {**GPT.tensor_parallel_plan, **self.moe_tensor_parallel_plan}
            self.tensor_parallel_plan = {  # patterns must match modules of this model
                k: v
                for k, v in styles.items()
                if not (k.startswith("blocks.*.mlp.shared") and not shared_expert)
                and not (k in ("blocks.*.mlp.fc", "blocks.*.mlp.proj") and not dense)
                and k != "embed"
            }  # no sequence parallelism: routing needs whole sequences
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

    def expert_parameter_count(self) -> int:
        """Parameters of the routed experts (what expert parallelism spreads over ranks)."""
        return sum(p.numel() for name, p in self.named_parameters() if ".mlp.experts." in name)

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: ``6·N`` for the weight matmuls (forward and backward) plus
        ``12·L·E·T`` for attention's score and value matmuls over ``T`` positions (PaLM, appendix
        B; ``E`` = heads × head size). Position embeddings are a lookup, not a matmul. ``N``
        counts the parameters a token goes through: of a mixture of experts' routed experts,
        ``top_k / n_experts`` (the active parameters)."""
        routed = self.expert_parameter_count()
        n = sum(p.numel() for p in self.parameters()) - self.embed.pos.weight.numel() - routed
        if self.n_experts:
            n += routed * self.top_k // self.n_experts
        return 6 * n + 12 * self.n_layer * self.n_embd * seq_len

    def activation_bytes(
        self, batch_size: int, seq_len: int, bytes_per_value: int, recompute: str = "none"
    ) -> int:
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

        A mixture-of-experts block counts its routed choices instead of the dense MLP
        (:meth:`_moe_activation_bytes`).

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
        moe = [blk.mlp for blk in self.blocks.values() if getattr(blk.mlp, "is_moe_layer", False)]
        extra = (
            0
            if recompute == "full"
            else sum(self._moe_activation_bytes(m, s * b, v) for m in moe)
            - len(moe) * 8 * s * b * h * v
        )
        return self.n_layer * per_layer + tail + ids + extra

    def _moe_activation_bytes(self, moe: nn.Module, tokens: int, v: int) -> int:
        """A mixture-of-experts MLP instead of the dense one's ``8·s·b·h`` values: each of the
        ``k`` choices of a token keeps its dispatched input and expert output (``h`` each) and
        its expert's GELU input and output (``H`` each, the expert's width), a shared expert its
        GELU input and output, and the router its fp32 logits and probabilities (``E`` each).
        Under expert parallelism a rank computes as many choices as it sends on average."""
        width = next(iter(moe.experts.values())).fc.out_features
        routed = moe.top_k * tokens * (2 * self.n_embd + 2 * width) * v
        shared = 2 * tokens * width * v if moe.shared is not None else 0
        return routed + shared + 2 * tokens * moe.n_experts * 4

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
        name="gpt",
        selected_by={"model._target_": GPTConfig._target_},
        provides=frozenset(
            {
                "model:tensor_parallel_plan",
                "model:activation_checkpointing_plan",
                "model:context_parallel",
                "model:experts",
            }
        ),
        description="plait's GPT: schema, checks, and what it lets split",
    )


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
        problems.append(
            f"model.n_embd={m.n_embd} is not divisible by model.n_head={m.n_head}: "
            "choose n_embd as a multiple of n_head"
        )
    if dims.cp > 1 and m.dropout > 0:
        problems.append(
            f"model.dropout={m.dropout} with parallel.cp={dims.cp}: the attention "
            "of context-parallel ranks has no dropout on its probabilities: set "
            "model.dropout=0 or parallel.cp=1"
        )
    divides = {"n_head": "attention heads", "vocab_size": "vocabulary"}
    if m.n_experts and m.expert_hidden is not None:
        divides["expert_hidden"] = "an expert's MLP width"
    return problems + expert_problems(cfg, dims) + tensor_parallel_problems(cfg, dims.tp, divides)


def expert_problems(cfg, dims) -> list[str]:
    """The mixture-of-experts settings, and how parallel.ep must divide them."""
    m, problems = cfg.model, []
    if not m.n_experts:
        if dims.ep > 1:
            problems.append(
                f"parallel.ep={dims.ep} spreads a mixture of experts' experts over "
                f"ranks, but model.n_experts=0 (dense MLPs): set model.n_experts to a "
                f"multiple of {dims.ep}, or parallel.ep=1"
            )
        return problems
    if dims.ep > 1 and dims.cp > 1:
        problems.append(
            f"parallel.ep={dims.ep} with parallel.cp={dims.cp}: expert parallelism "
            "is carved out of the dp ranks alone, not the dp x cp ranks that share "
            "gradients (not built): set parallel.ep=1 or parallel.cp=1"
        )
    if m.router not in ROUTERS:
        problems.append(f"model.router={m.router}: choose one of {', '.join(ROUTERS)}")
    if m.top_k > m.n_experts:
        problems.append(
            f"model.top_k={m.top_k} is larger than model.n_experts={m.n_experts}: each "
            f"token goes to top_k different experts; set model.top_k <= "
            f"{m.n_experts}"
        )
    if m.n_experts % dims.ep:
        fits = [e for e in range(1, dims.dp + 1) if dims.dp % e == 0 and m.n_experts % e == 0]
        problems.append(
            f"parallel.ep={dims.ep} does not divide model.n_experts={m.n_experts}: "
            f"each expert-parallel rank holds n_experts/ep experts; choose "
            f"parallel.ep in {fits}, or model.n_experts as a multiple of {dims.ep}"
        )
    if cfg.precision == "fp16" and (m.aux_loss_coeff or m.z_loss_coeff):
        problems.append(
            "precision=fp16 with model.n_experts: the router's auxiliary losses enter "
            "the backward unscaled by the fp16 loss scale; use precision=bf16 or "
            "fp32, or model.aux_loss_coeff=0 model.z_loss_coeff=0"
        )
    return problems
