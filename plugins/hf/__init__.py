"""``model=hf model.path=<dir>``: pretrained Hugging Face checkpoints in and out under every
layout.

    plait train model=hf model.path=~/models/Qwen2-0.5B data=shards data.path=shards/ \\
        parallel.tp=2 parallel.pp=2 launcher.nproc_per_node=4
    plait train model=hf model.path=my-config-dir model.pretrained=false   # random weights
    plait export runs/exp1 format=hf out=exp1-hf      # from_pretrained loads it
    plait train model=hf ... checkpoint.hf_every=500  # the same format during training

The model is ``transformers``' own class, built on the meta device; each rank reads only the
boxes of the checkpoint it keeps (:mod:`.model`, :mod:`.checkpoint_files`); tensor and pipeline
parallelism come from the config's ``base_model_tp_plan`` / ``base_model_pp_plan``
(:mod:`.plans`), expert parallelism (``parallel.ep``) from its ``base_model_ep_plan``
(:mod:`.experts`: Qwen3-MoE's and Mixtral's experts, one module per expert under plait's expert
contract); activation checkpointing recomputes whole decoder layers. Before launch it
refuses, naming the fix: a path that is neither a directory nor a cached model, a directory
without ``config.json``, a missing or truncated shard (sizes against the headers and the
index), a checkpoint lacking the model's parameters, a dtype the run cannot hold (quantized or
fp64 weights; bf16 weights under ``precision=fp16``), a context longer than the model's,
``parallel.tp`` with no tp plan, a style plait cannot honour (``packed_colwise``, ...), or sizes
tp does not divide (heads, KV heads, every split layer), ``parallel.ep`` with no ep plan, a
mixture-of-experts block plait does not serve, expert counts ep does not divide, or context
parallelism, and data tokenized with another tokenizer than the model's own ``tokenizer.json``.
Under ``parallel.cp`` the attention of Llama-family models (any whose attention goes through
``transformers``' attention interface and is plain causal softmax) exchanges keys and values
(:mod:`.context_parallel`); other architectures are refused, naming why. See ``docs/hf.md``.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from omegaconf import MISSING, OmegaConf

from plait import hookimpl
from plait.config import ModelConfig
from plait.meta import meta_model
from plait.types import PluginInfo

TARGET = "plait.plugins.hf.model.build_hf"
BUILD_CHECKS = "model:build_checks"


@dataclass
class HFModelConfig(ModelConfig):
    _target_: str = TARGET
    path: str = MISSING  # a directory (config.json + *.safetensors) or a model in the HF cache
    pretrained: bool = True  # false: transformers' init of the config's architecture, by name


@hookimpl
def plait_declare() -> PluginInfo:
    return PluginInfo(
        name="hf",
        selected_by={"model._target_": TARGET},
        provides=frozenset(
            {
                "model:hf_format",
                "model:tensor_parallel_plan",
                "model:activation_checkpointing_plan",
                "model:experts",
                "model:context_parallel",
                BUILD_CHECKS,
            }
        ),
        description="transformers causal LMs from a local directory, read slice by slice",
        preload=frozenset({"plait.plugins.hf.preload", "plait.plugins.hf.model"}),
    )


@hookimpl
def plait_register_configs(config_store) -> None:
    config_store.store(group="model", name="base_hf", node=HFModelConfig)


@hookimpl
def plait_validate(cfg, dims, hook) -> list[str]:
    if importlib.util.find_spec("transformers") is None:
        return ['model=hf needs transformers: pip install -e ".[hf]"']
    from plait.plugins.hf import checks, experts
    from plait.plugins.hf.model import CONFIG, load_config, resolve_directory

    m = cfg.model
    if OmegaConf.is_missing(m, "path"):
        return [
            "model=hf needs model.path=<a directory with config.json and *.safetensors, or a "
            "model name already in the local Hugging Face cache>"
        ]
    try:
        directory = resolve_directory(m.path)
    except ValueError as e:
        return [str(e)]
    if not (directory / CONFIG).is_file():
        return [
            f"model.path={m.path} holds no {CONFIG}: give a directory written by "
            "save_pretrained (config.json and *.safetensors weights)"
        ]
    try:
        config = load_config(directory)
    except Exception as e:
        return [
            f"model.path={m.path}: transformers cannot read its {CONFIG} ({type(e).__name__}: "
            f"{e}): give a causal LM's directory"
        ]
    problems = checks.dtype_problems(cfg, config)
    if m.pretrained:
        problems += checks.file_problems(cfg, directory)
    if problems:
        return problems
    model = meta_model(hook, cfg)
    if model is None:
        return [checks.build_problem(cfg, directory, config)]
    if m.pretrained:
        problems += checks.checkpoint_problems(cfg, model)
    problems += checks.context_problems(cfg, config)
    if dims.tp > 1:
        problems += checks.tensor_parallel_problems(cfg, model, config, dims.tp)
    problems += experts.loss_problems(cfg, model)
    if dims.ep > 1:
        problems += experts.refusals(cfg, model, dims)
    if dims.cp > 1 and model.context_parallel_plan is not None:
        from plait.plugins.hf import context_parallel

        problems += context_parallel.problems(cfg, model, config, dims.cp)
    return problems + checks.tokenizer_problems(cfg, hook, directory, config)


@hookimpl
def plait_apply_context_parallel(cfg, model, topology) -> None:
    """Under ``parallel.cp > 1``, ``transformers`` calls the attention cores the context-parallel
    plugin replaces (:mod:`.context_parallel`)."""
    if topology.dims.cp > 1 and getattr(model, "context_parallel_plan", None):
        from plait.plugins.hf.context_parallel import use_core_attention

        use_core_attention(model)


@hookimpl
def plait_export_model(cfg, state_dict, model, format, out):
    """``plait export <run> format=hf out=<dir>``."""
    if format != "hf":
        return None
    from plait.plugins.hf.writer import is_transformers_model, write_model

    if not is_transformers_model(model):
        raise ValueError(
            f"format=hf writes a transformers model; model._target_="
            f"{cfg.model._target_} is not one: export without format= (a state_dict)"
        )
    return write_model(model, state_dict, Path(out))
