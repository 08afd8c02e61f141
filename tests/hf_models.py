"""Tiny Hugging Face checkpoints for the tests of ``model=hf``, written with ``save_pretrained``
(no network): Llama, Qwen2, Mistral, GPT-NeoX and Phi-3, each 4 layers of width 64, sharing one
byte-level BPE tokenizer (512 ids, trained here on a few standard-library files) so that one set
of prepared shards fits every family; and two mixtures of experts, Qwen3-MoE and Mixtral, with 4
experts of width 32 (top 2) per MoE layer and no tokenizer (they train on plait's byte data)."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import torch

VOCAB = 512
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    max_position_embeddings=64,
    eos_token_id=0,
    bos_token_id=None,
    tie_word_embeddings=False,
)


def family_config(family: str, **overrides):
    import transformers as T

    small = {**SMALL, "num_key_value_heads": 2, **overrides}
    if family == "llama":
        return T.LlamaConfig(**small)
    if family == "qwen2":  # biases on q, k, v
        return T.Qwen2Config(**small)
    if family == "mistral":
        return T.MistralConfig(**small)
    if family == "gpt_neox":  # fused per-head qkv, LayerNorm with bias, partial rotary
        small.pop("num_key_value_heads")
        return T.GPTNeoXConfig(**small)
    if family == "phi3":  # fused qkv / gate_up (gathered outputs), a padding row
        return T.Phi3Config(pad_token_id=1, **small)
    if family == "qwen3_moe":  # layers 0 and 2 MoE (top 2 of 4, not renormalised), 1 dense,
        # the router's load-balancing loss in the objective (output_router_logits)
        moe = dict(
            moe_intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
            num_hidden_layers=3,
            mlp_only_layers=[1],
            output_router_logits=True,
            router_aux_loss_coef=0.01,
        )
        return T.Qwen3MoeConfig(**{**small, **moe, **overrides})
    if family == "mixtral":  # every layer MoE, top 2 of 4 renormalised; stored as w1/w3/w2
        moe = dict(
            intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=2
        )
        return T.MixtralConfig(**{**small, **moe, **overrides})
    if family in SCALED_FAMILIES:
        return scaled_config(family, small, overrides)
    raise ValueError(family)


# Families whose forward does more than chain the modules their plans name, each with its scaling
# settings away from its defaults: Gemma's embedding scaled by sqrt(hidden) inside the embedding
# module (a non-persistent buffer), Gemma 2's final and attention soft-capping (and its sliding
# window, shorter than the sequence, on every other layer), Cohere's logit_scale after the head,
# MiniCPM3's scale_emb, residual scales scale_depth/sqrt(layers) and logits divided by
# hidden/dim_model_base (with its multi-head latent attention), and Granite's multipliers, whose
# embedding multiplier its base model applies to inputs_embeds (so no pipeline stage after the
# first can run its forward faithfully). Two layers, width 64; initializer_range 0.2, so that the
# logits reach the soft cap's bend.
SCALED_FAMILIES = ("gemma", "gemma2", "cohere", "minicpm3", "granite")


def scaled_config(family: str, small: dict, overrides: dict):
    import transformers as T

    small = {**small, "num_hidden_layers": 2, "initializer_range": 0.1, "pad_token_id": None}
    if family == "gemma":
        return T.GemmaConfig(**{**small, "head_dim": 16, **overrides})
    if family == "gemma2":
        gemma2 = dict(
            head_dim=16,
            final_logit_softcapping=3.0,  # 30.0 by default
            attn_logit_softcapping=5.0,  # 50.0
            query_pre_attn_scalar=8,  # 256
            sliding_window=8,  # 4096; layer 0 slides, layer 1 attends to everything
        )
        return T.Gemma2Config(**{**small, **gemma2, **overrides})
    if family == "cohere":
        return T.CohereConfig(**{**small, "logit_scale": 3.0, **overrides})  # 0.0625
    if family == "minicpm3":
        mla = dict(
            num_key_value_heads=4,
            q_lora_rank=32,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            scale_emb=3.0,  # 12
            scale_depth=2.0,  # 1.4
            dim_model_base=16,  # 256: logits divided by 64 / 16 = 4
        )
        return T.MiniCPM3Config(**{**small, **mla, **overrides})
    if family == "granite":
        granite = dict(
            embedding_multiplier=2.0,
            residual_multiplier=0.5,
            attention_multiplier=0.1,
            logits_scaling=4.0,
        )
        return T.GraniteConfig(**{**small, **granite, **overrides})
    raise ValueError(family)


MOE_FAMILIES = ("qwen3_moe", "mixtral")


def write_moe_checkpoint(directory: Path, family: str, seed: int = 0, **overrides) -> Path:
    """A randomly initialised mixture of experts saved with ``save_pretrained`` (each expert's
    weights apart, as ``transformers`` writes them), without a tokenizer."""
    from transformers import AutoModelForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(family_config(family, **overrides)).save_pretrained(directory)
    return directory


FAMILIES = ("llama", "qwen2", "mistral", "gpt_neox", "phi3")


def corpus_files(start: int, count: int) -> list[Path]:
    return sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[start : start + count]


def write_tokenizer(directory: Path) -> None:
    """A byte-level BPE of 512 ids (``<|endoftext|>`` is 0) and its tokenizer_config.json."""
    from plait.plugins.data.tokenizer import train_bpe

    tokenizer = train_bpe((p.read_bytes() for p in corpus_files(0, 20)), VOCAB)
    (directory / "tokenizer.json").write_text(tokenizer.json)
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))


def write_checkpoint(
    directory: Path,
    family: str,
    seed: int = 0,
    dtype=torch.float32,
    max_shard_size: str | None = None,
    tokenizer_from: Path | None = None,
    **overrides,
) -> Path:
    """A randomly initialised ``family`` model saved with ``save_pretrained`` (sharded when
    ``max_shard_size`` is given), with the tokenizer of ``tokenizer_from`` (or a new one)."""
    from transformers import AutoModelForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(family, **overrides), dtype=dtype)
    options = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **options)
    if tokenizer_from is None:
        write_tokenizer(directory)
    else:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (directory / name).write_bytes((tokenizer_from / name).read_bytes())
    return directory
