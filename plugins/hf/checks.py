"""What ``model=hf`` refuses before launch, each problem naming the setting and the fix. Read from
``config.json``, the safetensors headers and the model built on the meta device: no tensor is
loaded."""

from __future__ import annotations

from fnmatch import fnmatchcase
from pathlib import Path

import torch.nn as nn

from plait.plugins.hf import plans
from plait.plugins.hf.checkpoint_files import FLOAT_DTYPES, CheckpointFiles

TOKENIZER = "tokenizer.json"


def build_problem(cfg, directory: Path, config) -> str:
    return (
        f"model.path={cfg.model.path}: transformers cannot build a causal LM from its config "
        f"(model_type {getattr(config, 'model_type', '?')!r}, architectures "
        f"{getattr(config, 'architectures', None)}): give the directory of a model "
        "AutoModelForCausalLM can build"
    )


def dtype_problems(cfg, config) -> list[str]:
    quantization = getattr(config, "quantization_config", None)
    if quantization:
        method = (
            quantization.get("quant_method")
            if isinstance(quantization, dict)
            else getattr(quantization, "quant_method", "?")
        )
        return [
            f"model.path={cfg.model.path} is quantized ({method}), a dtype the run cannot "
            "hold: plait trains fp32 master weights from fp32, bf16 or fp16 checkpoints; "
            "give the unquantized model"
        ]
    return []


def file_problems(cfg, directory: Path) -> list[str]:
    files = CheckpointFiles(directory)
    problems = [f"model.path={cfg.model.path}: {p}" for p in files.problems()]
    if problems:
        return problems
    held = {}
    for name, entry in files.entries.items():
        held.setdefault(entry.dtype, name)
    odd = {dtype: name for dtype, name in held.items() if dtype not in FLOAT_DTYPES}
    if odd:
        dtype, name = next(iter(odd.items()))
        problems.append(
            f"model.path={cfg.model.path} holds {dtype} tensors (e.g. {name}), a "
            "dtype the run cannot hold: plait trains fp32 master weights from F32, "
            "BF16 or F16 checkpoints; convert it, or model.pretrained=false"
        )
    if cfg.precision == "fp16" and "BF16" in held:
        problems.append(
            f"precision=fp16 cannot hold model.path={cfg.model.path}'s bf16 weights "
            "(bf16 reaches 3e38, fp16 65504: activations overflow): use "
            "precision=bf16 or fp32"
        )
    return problems


def checkpoint_problems(cfg, model: nn.Module) -> list[str]:
    """Every parameter of the model in the checkpoint, with its shape."""
    from plait.plugins.hf.model import checkpoint_name

    files, aliases = model.plait_checkpoint.value, model.plait_aliases.value
    names = model.plait_names.value
    missing, resized = [], []
    for name, p in model.named_parameters():
        stored = checkpoint_name(names, aliases, name)
        if stored is None:
            missing.append(name)
        elif files.entries[stored].shape != tuple(p.shape):
            resized.append(
                f"{stored}: {list(files.entries[stored].shape)} in the checkpoint, "
                f"{list(p.shape)} in the model"
            )
    problems = []
    if missing:
        problems.append(
            f"model.path={cfg.model.path} lacks {len(missing)} of the model's "
            f"parameters, e.g. {missing[:3]}: plait reads tensors under the names "
            "transformers loads them by (renames and the base-model prefix), but "
            "does not convert weights it fuses or splits on load; give a checkpoint "
            "save_pretrained wrote with this transformers, or "
            "model.pretrained=false"
        )
    if resized:
        problems.append(
            f"model.path={cfg.model.path}: tensors do not match config.json: "
            f"{'; '.join(resized[:3])}: the weights and the config come from "
            "different models"
        )
    return problems


def context_problems(cfg, config) -> list[str]:
    limit = getattr(config.get_text_config(), "max_position_embeddings", None)
    if limit is None or cfg.train.seq_len <= limit:
        return []
    return [
        f"train.seq_len={cfg.train.seq_len} is longer than model.path={cfg.model.path}'s "
        f"context (max_position_embeddings={limit}): lower train.seq_len"
    ]


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def tensor_parallel_problems(cfg, model: nn.Module, config, tp: int) -> list[str]:
    """No plan, styles plait cannot honour, heads (and KV heads) tp does not divide, then any
    layer the plan splits along a size tp does not divide."""
    problems = plans.refusals(model, tp, model.plait_architecture)
    text = config.get_text_config()
    for key, what in (
        ("num_attention_heads", "attention heads"),
        ("num_key_value_heads", "key/value heads"),
    ):
        heads = getattr(text, key, None)
        if heads and heads % tp:
            problems.append(
                f"parallel.tp={tp} does not divide {key}={heads} ({what}) of "
                f"model.path={cfg.model.path}: choose tp in {divisors(heads)}"
            )
    if problems:
        return problems
    plan = model.tensor_parallel_plan or {}
    for name, module in model.named_modules():
        style = style_of(plan, name)
        size = split_size(module, style)
        if size is not None and size % tp:
            problems.append(
                f"parallel.tp={tp} does not divide {name} ({style}, {size} "
                f"{'rows' if isinstance(module, nn.Embedding) else 'features'}) of "
                f"model.path={cfg.model.path}: choose tp in {divisors(size)}"
            )
            break
    return problems


def style_of(plan: dict[str, str], name: str) -> str:
    """The style a tensor-parallel plan gives module ``name``: its first matching pattern's
    (fnmatch), else ``replicate`` (the tensor-parallel plugin's rule, which applies the plan)."""
    return next(
        (style for pattern, style in plan.items() if fnmatchcase(name, pattern)), "replicate"
    )


def split_size(module: nn.Module, style: str) -> int | None:
    if style == "vocab" and isinstance(module, nn.Embedding):
        return module.num_embeddings
    if style in ("colwise", "colwise_gather_output", "vocab") and isinstance(module, nn.Linear):
        return module.out_features
    if style in ("rowwise", "rowwise_split_input") and isinstance(module, nn.Linear):
        return module.in_features
    return None


def tokenizer_problems(cfg, hook, directory: Path, config) -> list[str]:
    """Data tokenized with another tokenizer than the model's own, or with ids beyond its
    vocabulary (the data plugin says which tokenizer made the data: ``plait_tokenizer``)."""
    data = hook.plait_tokenizer(cfg=cfg)
    if data is None:
        return []
    vocab = config.get_text_config().vocab_size
    problems = []
    own = directory / TOKENIZER
    if cfg.model.pretrained and own.is_file():
        from plait.plugins.data.tokenizer import load_tokenizer_file

        if load_tokenizer_file(own).identity != data.identity:
            problems.append(
                f"the data was tokenized with the {data.name} tokenizer "
                f"({data.identity[:19]}), not model.path={cfg.model.path}'s own "
                f"{TOKENIZER}: its ids mean other text to this model; prepare the "
                f"data with it (plait prepare data.tokenizer={cfg.model.path} "
                "out=...)"
            )
    if data.vocab_size > vocab:
        problems.append(
            f"the data's tokenizer has {data.vocab_size} ids, model.path="
            f"{cfg.model.path}'s vocabulary {vocab}: prepare the data with the "
            f"model's tokenizer (plait prepare data.tokenizer={cfg.model.path})"
        )
    return problems
