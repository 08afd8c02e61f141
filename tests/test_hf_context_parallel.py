"""Context parallelism for Hugging Face models (``model=hf parallel.cp=2``): the attention of
every Llama-family architecture the tests build (Llama, Qwen2, Qwen3, Mistral, GPT-NeoX, Phi-3)
exchanges keys and values through ``transformers``' attention interface, and the architectures
plait cannot serve are refused before launch.

- No processes: each family's plan (the base model takes the ids, one attention core per layer),
  and the refusals (an attention outside the interface, attention sinks, soft-capped logits, a
  sliding window shorter than the sequence, attention dropout, Ulysses' heads).
- One spawned group of 2 ranks: every family, 20 AdamW steps under cp=2 with ring attention and
  with Ulysses against the same loop in one process (fp32: loss within 1e-5, grad norm within
  1e-4), with the K/V exchanges counted against the theory (a model whose attention did not
  exchange would train on half its context and send nothing).
- Real ``plait train model=hf parallel.cp=2`` runs (ring and Ulysses) are in ``test_hf.py``,
  against its one-process run.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hf_models import FAMILIES, family_config
from test_context_parallel import BACKENDS, SEQ, STEPS, cross_entropy, train_losses

from plait.meta import ParameterInit, materialize, meta_device
from plait.plugins.context_parallel.apply import (
    SequenceShardLoss,
    apply_context_parallel,
    exchange_bytes,
    layout_for,
)
from plait.plugins.context_parallel.ring import ExchangeStats
from plait.testing import spawn

os.environ.setdefault("DS_ACCELERATOR", "cpu")

LOSS_TOL, NORM_TOL = 1e-5, 1e-4  # the issue's: absolute, fp32, over 20 steps
ALL = (*FAMILIES, "qwen3")
LAYERS, HEAD_DIM = 4, 16  # hf_models.SMALL: 4 layers, 4 heads of 16


def config_of(family: str, **overrides):
    """``hf_models``' families, and Qwen3 (q/k norms before the rotary embedding) likewise."""
    if family == "qwen3":
        from hf_models import SMALL
        from transformers import Qwen3Config

        return Qwen3Config(**{**SMALL, "num_key_value_heads": 2, "head_dim": HEAD_DIM, **overrides})
    return family_config(family, **overrides)


SEED = 1  # at seed 0 the tiny Qwen2 is chaotic under this loop: a 1e-7 relative change of its
# initial weights, or transformers' own eager attention in place of sdpa, moves its 20-step losses
# by 3-4e-5 in one process (measured); at seed 1 by 5e-7, as every other family at either seed


def built(family: str) -> torch.nn.Module:
    """What ``model=hf model.pretrained=false`` builds: the meta model, initialised by name."""
    from plait.plugins.hf.model import hf_model

    with meta_device():
        model = hf_model(config_of(family))
    return materialize(model, ParameterInit.of(model, SEED))


def kv_width(family: str) -> int:
    return HEAD_DIM * (getattr(config_of(family), "num_key_value_heads", None) or 4)


# ---------------------------------------------------------------------------------------------
# no processes
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ALL)
def test_each_family_plans_its_base_model_and_one_attention_core_per_layer(family):
    """The base model takes the ids (and is given positions); each causal attention module gets
    a parameter-free core, so parameter names (and checkpoints) do not change; without cp
    ``transformers`` keeps its own attention (sdpa)."""
    from plait.plugins.hf.model import hf_model

    with meta_device():
        model = hf_model(config_of(family))
    prefix = model.base_model_prefix
    attention = "attention" if family == "gpt_neox" else "self_attn"
    assert model.context_parallel_plan == {
        prefix: "sequence_split",
        **{f"{prefix}.layers.{i}.{attention}.core_attention": "attention" for i in range(LAYERS)},
    }
    assert model.n_head == 4
    assert not any("core_attention" in name for name in model.state_dict())
    assert model.config._attn_implementation == "sdpa"


def write_config(directory: Path, config) -> Path:
    config.save_pretrained(directory)
    return directory


def cp_problems(path: Path, *overrides: str) -> str:
    from plait.plan import make_plan

    return "\n".join(
        make_plan(
            [
                "tracker=none",
                "model=hf",
                f"model.path={path}",
                "model.pretrained=false",
                "parallel.cp=2",
                "launcher.nproc_per_node=2",
                "train.seq_len=32",
                *overrides,
            ]
        ).problems
    )


def test_architectures_plait_cannot_serve_are_refused_before_launch(tmp_path):
    from transformers import BloomConfig, Gemma2Config, GPT2Config, GptOssConfig

    target = "model._target_=plait.plugins.hf.model.build_hf"
    bloom = write_config(
        tmp_path / "bloom", BloomConfig(vocab_size=512, hidden_size=64, n_layer=2, n_head=4)
    )
    assert (
        f"parallel.cp=2: plait cannot replace the attention of {target}: BloomForCausalLM's "
        "attention does not go through transformers' attention interface "
        "(ALL_ATTENTION_FUNCTIONS), where plait puts its exchange; use a model that has one"
        in cp_problems(bloom)
    )
    gemma2 = write_config(
        tmp_path / "gemma2",
        Gemma2Config(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=64,
        ),
    )
    assert (
        "Gemma2ForCausalLM soft-caps its attention logits (attn_logit_softcapping)"
        in cp_problems(gemma2)
    )
    window = write_config(tmp_path / "window", config_of("mistral", sliding_window=16))
    assert (
        f"parallel.cp=2: model.path={window} attends within a sliding window of 16 tokens "
        "(sliding_window), shorter than train.seq_len=32; plait's context-parallel attention "
        "sees every earlier token: set train.seq_len <= 16, or parallel.cp=1" in cp_problems(window)
    )
    assert cp_problems(window, "train.seq_len=16") == ""  # a window the sequence fits in: served
    dropout = write_config(tmp_path / "dropout", config_of("llama", attention_dropout=0.1))
    assert (
        f"parallel.cp=2: model.path={dropout} drops out attention probabilities "
        "(model.layers.0.self_attn: 0.1); the attention of context-parallel ranks has no "
        "dropout on its probabilities" in cp_problems(dropout)
    )
    gpt2 = write_config(
        tmp_path / "gpt2",
        GPT2Config(vocab_size=512, n_embd=32, n_layer=2, n_head=4, n_positions=64),
    )
    assert "(transformer.h.0.attn: 0.1)" in cp_problems(gpt2)  # attn_pdrop's default
    oss = write_config(
        tmp_path / "gpt_oss",
        GptOssConfig(
            vocab_size=512,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            num_local_experts=4,
        ),
    )
    assert (
        "GptOssForCausalLM's attention module holds parameters of its own "
        "(model.layers.0.self_attn.sinks) that enter its softmax" in cp_problems(oss)
    )
    llama = write_config(tmp_path / "llama", config_of("llama"))
    assert cp_problems(llama) == cp_problems(llama, "context_parallel.backend=ulysses") == ""
    assert (
        "context_parallel.backend=ulysses with parallel.cp=8: the heads (the model's "
        "n_head=4) are not divisible by cp"
        in cp_problems(
            llama, "context_parallel.backend=ulysses", "parallel.cp=8", "launcher.nproc_per_node=8"
        )
    )


# ---------------------------------------------------------------------------------------------
# every family, 20 steps under cp=2 against one process, in one spawned group of 2 ranks
# ---------------------------------------------------------------------------------------------


def _train_group(rank: int, world: int, out: str) -> None:
    from plait.plugins.hf.context_parallel import use_core_attention

    torch.set_num_threads(1)
    results = {}
    for family in ALL:
        results[f"{family}/one"] = train_losses(built(family), cross_entropy)
        for backend in BACKENDS:
            stats, model = ExchangeStats(), built(family)
            layout = layout_for(backend, SEQ, world, rank)
            apply_context_parallel(model, backend, layout, dist.group.WORLD, stats)
            use_core_attention(model)
            results[f"{family}/{backend}"] = train_losses(
                model, SequenceShardLoss(cross_entropy, layout), dist.group.WORLD, world
            )
            results[f"{family}/{backend}/sent"] = stats.take()
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def group_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf_cp_group")
    spawn(_train_group, 2, str(out))
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize("family", ALL)
def test_cp2_ring_and_ulysses_train_like_one_process(group_results, family):
    """20 steps, fp32, batches of 4 x 48 tokens: losses within 1e-5 and grad norms within 1e-4
    of the same loop in one process, with rotary positions of each rank's zigzag (ring) or
    contiguous (Ulysses) tokens; and every layer exchanged exactly the theory's keys and values
    each step (grouped-query: ring sends only the 2 key/value heads)."""
    for results in group_results:
        losses, norms = results[f"{family}/one"]
        assert losses[-1] < losses[0] - 0.05  # it learned
        for backend in BACKENDS:
            cp_losses, cp_norms = results[f"{family}/{backend}"]
            assert len(cp_losses) == STEPS
            assert np.abs(np.subtract(cp_losses, losses)).max() <= LOSS_TOL, backend
            assert np.abs(np.subtract(cp_norms, norms)).max() <= NORM_TOL, backend
            sent = results[f"{family}/{backend}/sent"]
            per_layer = {"ring": 3 * 2 - 2, "ulysses": 8}[backend]
            assert sent["exchanges"] == STEPS * LAYERS * per_layer, backend
            assert sent["bytes_sent"] == STEPS * LAYERS * exchange_bytes(
                backend, SEQ, 4, 4 * HEAD_DIM, 2, 4, kv_width(family)
            ), backend
