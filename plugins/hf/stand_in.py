"""A small seeded model of the same family, on which plait checks before the first step that a
layout computes the model's own forward (:meth:`PlaitCausalLM.stand_in`; the pipeline and
tensor-parallel plugins compare their cut with the unsplit forward on it).

Whether a layout computes a family's forward is a property of the family's code and settings
(what its forward does between and after the modules the plans name), not of the weights' values
or widths. A model of at most :data:`WHOLE_LIMIT` parameters is its own stand-in (its config as it
is); a larger one gets its config with every width shrunk and everything else kept:

- kept: the class, the layer count and layer types, every multiplier, soft cap and flag, the
  rotary settings, the expert counts, the ratio of query to key/value heads (up to 2);
- shrunk: ``num_key_value_heads`` to ``tp`` (the fewest that ``tp`` still divides), the query
  heads to at most twice that, 16 features per head (``hidden_size`` = heads x 16, ``head_dim``
  16 where the config names one), every ``*intermediate_size`` to twice the width, the
  vocabulary to 128 (a multiple of ``tp``; special token ids beyond it dropped), multi-head latent
  attention's ranks and head widths to 32 / 16 / 8 and MiniCPM3's ``dim_model_base`` with the
  width (its logits' divisor ``hidden / dim_model_base`` stays near its own), a sliding window to
  at most 8 tokens (so the check's 32 tokens see it).

A config that is not a plain text config (a composite with a ``text_config``) is not shrunk: a
large one has no stand-in, and the checks refuse the layout rather than train it unchecked.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn as nn

WHOLE_LIMIT = 8_000_000  # parameters: a model this small is its own stand-in
HEAD_WIDTH, VOCAB = 16, 128
LATENT = {  # multi-head latent attention (MiniCPM3, DeepSeek-V2): ranks and per-head widths
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
}
SPECIAL_TOKENS = ("pad_token_id", "bos_token_id", "eos_token_id")
WINDOW = 8


class NoStandIn(ValueError):
    """The family's config cannot be shrunk into a stand-in."""


def stand_in_config(config, parameters: int, tp: int = 1):
    """``config`` itself (a copy) when the model has at most :data:`WHOLE_LIMIT` parameters,
    else its shrunk copy (see the module docstring)."""
    if parameters <= WHOLE_LIMIT:
        return copy.deepcopy(config)
    if config.get_text_config() is not config:
        raise NoStandIn(
            f"{type(config).__name__} nests its text model's config, which plait does not shrink"
        )
    settings = config.to_dict()
    heads = settings["num_attention_heads"]
    kv_heads = settings.get("num_key_value_heads") or heads
    kv_heads_kept = tp if kv_heads % tp == 0 else kv_heads
    heads_kept = kv_heads_kept * min(heads // kv_heads, 2)
    width, hidden = heads_kept * HEAD_WIDTH, settings["hidden_size"]
    settings.update(num_attention_heads=heads_kept, hidden_size=width)
    if settings.get("num_key_value_heads") is not None:
        settings["num_key_value_heads"] = kv_heads_kept
    if settings.get("head_dim") is not None:
        settings["head_dim"] = HEAD_WIDTH
    for key, value in settings.items():
        if key.endswith("intermediate_size") and isinstance(value, int) and value > 0:
            settings[key] = 2 * width
    settings["vocab_size"] = tp * math.ceil(VOCAB / tp)
    for key in SPECIAL_TOKENS:
        ids = settings.get(key)
        if isinstance(ids, int) and ids >= settings["vocab_size"]:
            settings[key] = None
        elif isinstance(ids, list):
            settings[key] = [i for i in ids if i < settings["vocab_size"]] or None
    if isinstance(settings.get("dim_model_base"), int):  # MiniCPM3: logits / (hidden / base)
        settings["dim_model_base"] = max(1, round(settings["dim_model_base"] * width / hidden))
    for key, value in LATENT.items():
        if settings.get(key) is not None:
            settings[key] = value
    if isinstance(settings.get("sliding_window"), int):
        settings["sliding_window"] = min(settings["sliding_window"], WINDOW)
    return type(config).from_dict(settings)


def build_stand_in(model: nn.Module, seed: int, tp: int = 1) -> nn.Module:
    """The stand-in of ``model`` (a ``model=hf`` model, meta or real, split or not), built on
    the CPU in fp32 and initialised by ``transformers``' own init from ``seed`` (every rank that
    builds it gets the same values)."""
    from plait.plugins.hf.model import hf_model

    config = stand_in_config(model.config, model.plait_parameter_count, tp)
    with torch.random.fork_rng(devices=[]), torch.device("cpu"):
        torch.manual_seed(seed)
        return hf_model(config)
