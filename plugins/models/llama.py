"""A Llama-architecture model from Hugging Face ``transformers``, built from a config with random
weights (no download): ``plait train model=llama_tiny``. Needs the ``hf`` extra
(``pip install -e ".[hf]"``); ``transformers`` is imported only when the model is built.

The model keeps Hugging Face's module names (``model.layers.<i>.self_attn.q_proj``, ``lm_head``),
so the built-in tensor-parallel plan reads like ``transformers``' own ``base_model_tp_plan``.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

from plait import hookimpl
from plait.config import AT_LEAST_1, POSITIVE, ModelConfig, range_problems
from plait.plugins.models.checks import context_problems, tensor_parallel_problems
from plait.types import PluginInfo


@dataclass
class LlamaModelConfig(ModelConfig):
    _target_: str = "plait.plugins.models.llama.build_llama"
    vocab_size: int = 256
    block_size: int = 64  # max_position_embeddings
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False


RANGES = {**{size: AT_LEAST_1 for size in (
    "vocab_size", "block_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads")}, "rms_norm_eps": POSITIVE}

# Hugging Face names of LlamaForCausalLM (the same split as transformers' own base_model_tp_plan).
# q/k/v and gate/up are separate linears there, so each enters the region on its own.
TENSOR_PARALLEL_PLAN = {
    "model.embed_tokens": "vocab",
    "model.layers.*.self_attn.q_proj": "colwise",
    "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise",
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
    "lm_head": "vocab",
}


def build_llama(vocab_size: int = 256, block_size: int = 64, hidden_size: int = 64,
                intermediate_size: int = 128, num_hidden_layers: int = 2,
                num_attention_heads: int = 4, num_key_value_heads: int = 2,
                rms_norm_eps: float = 1e-5, tie_word_embeddings: bool = False) -> torch.nn.Module:
    """A randomly initialised ``LlamaForCausalLM`` whose ``forward(ids)`` returns the logits."""
    from transformers import LlamaConfig, LlamaForCausalLM

    class LlamaLM(LlamaForCausalLM):
        tensor_parallel_plan = TENSOR_PARALLEL_PLAN
        # The attention core is a function inside transformers' attention, not a module:
        # whole decoder layers only.
        activation_checkpointing_plan = {"full": "model.layers.*"}

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # plait's model contract
            return super().forward(input_ids=input_ids, use_cache=False).logits

        def flops_per_token(self, seq_len: int) -> int:
            """``6·N`` for the weight matmuls plus ``12·L·E·T`` for attention (PaLM, appendix
            B), ``N`` without the embedding lookup table (kept when tied: it is the head)."""
            c = self.config
            n = sum(p.numel() for p in self.parameters())
            if not c.tie_word_embeddings:
                n -= self.model.embed_tokens.weight.numel()
            return 6 * n + 12 * c.num_hidden_layers * c.hidden_size * seq_len

    config = LlamaConfig(
        vocab_size=vocab_size, max_position_embeddings=block_size, hidden_size=hidden_size,
        intermediate_size=intermediate_size, num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads, num_key_value_heads=num_key_value_heads,
        rms_norm_eps=rms_norm_eps, tie_word_embeddings=tie_word_embeddings,
        attention_dropout=0.0, use_cache=False,
    )
    config._attn_implementation = "sdpa"
    return LlamaLM(config)


@hookimpl
def plait_declare() -> PluginInfo:
    return PluginInfo(name="llama", selected_by={"model._target_": LlamaModelConfig._target_},
                      provides=frozenset({"model:tensor_parallel_plan",
                                          "model:activation_checkpointing_plan"}),
                      description="transformers' Llama built from a config")


@hookimpl
def plait_register_configs(config_store) -> None:
    config_store.store(group="model", name="base_llama", node=LlamaModelConfig)


@hookimpl
def plait_validate(cfg, dims) -> list[str]:
    if importlib.util.find_spec("transformers") is None:
        return ["model=llama_tiny needs transformers: pip install -e \".[hf]\""]
    m = cfg.model
    problems = range_problems("model", m, RANGES)
    if problems:
        return problems
    problems = context_problems(cfg, m.block_size)
    if m.hidden_size % m.num_attention_heads:
        problems.append(f"model.hidden_size={m.hidden_size} is not divisible by "
                        f"model.num_attention_heads={m.num_attention_heads}")
    if m.num_attention_heads % m.num_key_value_heads:
        problems.append(f"model.num_attention_heads={m.num_attention_heads} is not divisible by "
                        f"model.num_key_value_heads={m.num_key_value_heads}")
    return problems + tensor_parallel_problems(cfg, dims.tp, {
        "num_attention_heads": "attention heads", "num_key_value_heads": "KV heads",
        "hidden_size": "hidden size", "intermediate_size": "MLP size",
        "vocab_size": "vocabulary"})
