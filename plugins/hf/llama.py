"""A Llama-architecture model from Hugging Face ``transformers``, built from a config with random
weights (no download, no directory): ``plait train model=llama_tiny``. Needs the ``hf`` extra
(``pip install -e ".[hf]"``); ``transformers`` is imported only when the model is built.

It is ``model=hf``'s model (:mod:`plait.plugins.hf.model`) for a ``LlamaConfig`` made from these
settings: ``transformers``' module names, its init by parameter name, and the tensor-parallel and
pipeline plans of the config's ``base_model_tp_plan`` / ``base_model_pp_plan``, and its
context-parallel plan (:mod:`plait.plugins.hf.context_parallel`); no plan is written here. It
lives in the ``hf`` package, beside the model it builds (the ``models`` package holds plait's own
models and the generic ``_target_`` builder, and imports nothing of ``hf``).
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
    _target_: str = "plait.plugins.hf.llama.build_llama"
    vocab_size: int = 256
    block_size: int = 64  # max_position_embeddings
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False


RANGES = {
    **{
        size: AT_LEAST_1
        for size in (
            "vocab_size",
            "block_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
        )
    },
    "rms_norm_eps": POSITIVE,
}


def build_llama(
    vocab_size: int = 256,
    block_size: int = 64,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    rms_norm_eps: float = 1e-5,
    tie_word_embeddings: bool = False,
) -> torch.nn.Module:
    """A ``LlamaForCausalLM`` with plait's contract (``forward(ids)`` returns the logits),
    initialised by parameter name."""
    from transformers import LlamaConfig

    from plait.plugins.hf.model import hf_model

    config = LlamaConfig(
        vocab_size=vocab_size,
        max_position_embeddings=block_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        rms_norm_eps=rms_norm_eps,
        tie_word_embeddings=tie_word_embeddings,
        attention_dropout=0.0,
        use_cache=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    return hf_model(config)


@hookimpl
def plait_declare() -> PluginInfo:
    return PluginInfo(
        name="llama",
        selected_by={"model._target_": LlamaModelConfig._target_},
        provides=frozenset(
            {
                "model:hf_format",
                "model:tensor_parallel_plan",
                "model:activation_checkpointing_plan",
                "model:context_parallel",
            }
        ),
        description="transformers' Llama built from settings (model=hf's model)",
    )


@hookimpl
def plait_register_configs(config_store) -> None:
    config_store.store(group="model", name="base_llama", node=LlamaModelConfig)


@hookimpl
def plait_validate(cfg, dims) -> list[str]:
    if importlib.util.find_spec("transformers") is None:
        return ['model=llama_tiny needs transformers: pip install -e ".[hf]"']
    m = cfg.model
    problems = range_problems("model", m, RANGES)
    if problems:
        return problems
    problems = context_problems(cfg, m.block_size)
    if m.hidden_size % m.num_attention_heads:
        problems.append(
            f"model.hidden_size={m.hidden_size} is not divisible by "
            f"model.num_attention_heads={m.num_attention_heads}"
        )
    if m.num_attention_heads % m.num_key_value_heads:
        problems.append(
            f"model.num_attention_heads={m.num_attention_heads} is not divisible by "
            f"model.num_key_value_heads={m.num_key_value_heads}"
        )
    return problems + tensor_parallel_problems(
        cfg,
        dims.tp,
        {
            "num_attention_heads": "attention heads",
            "num_key_value_heads": "KV heads",
            "hidden_size": "hidden size",
            "intermediate_size": "MLP size",
            "vocab_size": "vocabulary",
        },
    )


@hookimpl
def plait_apply_context_parallel(cfg, model, topology) -> None:
    """Under ``parallel.cp > 1``, as ``model=hf``: ``transformers`` calls the attention cores the
    context-parallel plugin replaces (:mod:`plait.plugins.hf.context_parallel`)."""
    if topology.dims.cp > 1:
        from plait.plugins.hf.context_parallel import use_core_attention

        use_core_attention(model)
