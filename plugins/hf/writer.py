"""Writing a model in Hugging Face's format: ``config.json``, safetensors weights (one file, or
one per pipeline stage with ``model.safetensors.index.json``), and the tokenizer and generation
files copied from the directory the model came from, so ``AutoModelForCausalLM.from_pretrained``
and ``AutoTokenizer.from_pretrained`` load the result.

Each tensor is written in the dtype the source checkpoint stored it in (fp32 without a source),
so HF → plait → HF without training is bit for bit the source (plait's fp32 master weights hold
every bf16/fp16 value exactly). A tied weight is written once, under the name ``transformers``
keeps (its ``all_tied_weights_keys`` lists the others). A directory is written as
``.<name>.partial`` and renamed into place when complete.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.nn as nn

from plait.plugins.hf.checkpoint_files import (
    FLOAT_DTYPES,
    INDEX,
    SINGLE,
    read_header,
    write_safetensors,
)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".msgpack", ".h5")
SKIPPED = {INDEX, "pytorch_model.bin.index.json", "config.json"}


def is_transformers_model(model: nn.Module) -> bool:
    """A model built by :func:`plait.plugins.hf.model.hf_model` (``model=hf``, ``llama_tiny``)."""
    from plait.plugins.hf.model import PlaitCausalLM

    return isinstance(model, PlaitCausalLM)


def tensors_to_write(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (the unsplit model's names, fp32) as ``save_pretrained`` would write it: tied
    copies dropped, names as it saves them (its conversion mapping reversed), each tensor in
    its source dtype."""
    from transformers.core_model_loading import revert_weight_conversion

    from plait.plugins.hf.model import as_transformers_class

    tied = (
        set(getattr(model, "all_tied_weights_keys", None) or {})
        if getattr(model.config.get_text_config(), "tie_word_embeddings", False)
        else set()
    )
    kept = {name: value for name, value in state.items() if name not in tied}
    with as_transformers_class(model):
        named = revert_weight_conversion(model, kept)
    source = model.plait_checkpoint.value
    entries = source.entries if source is not None else {}
    out = {}
    for name, value in named.items():
        entry = entries.get(name)
        dtype = FLOAT_DTYPES[entry.dtype] if entry is not None else torch.float32
        out[name] = value.detach().to("cpu", dtype)
    return out


def copy_side_files(model: nn.Module, directory: Path) -> None:
    """``config.json`` and the tokenizer / generation files of the source directory (the model's
    config when there is none)."""
    source = model.plait_source_directory.value
    if source is not None and (Path(source) / "config.json").exists():
        shutil.copyfile(Path(source) / "config.json", directory / "config.json")
        for file in sorted(Path(source).iterdir()):
            if (
                file.is_file()
                and not file.name.startswith(".")
                and file.name not in SKIPPED
                and not file.name.endswith(WEIGHT_SUFFIXES)
            ):
                shutil.copyfile(file, directory / file.name)
    else:
        model.config.to_json_file(str(directory / "config.json"))


def write_index(directory: Path, files: list[str]) -> None:
    """``model.safetensors.index.json`` for ``files`` (read back from their headers)."""
    weight_map, total = {}, 0
    for file in files:
        header, _ = read_header(directory / file)
        for name, entry in header.items():
            weight_map[name] = file
            total += entry["data_offsets"][1] - entry["data_offsets"][0]
    text = json.dumps(
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
        indent=2,
    )
    (directory / INDEX).write_text(text)


def stage_file(stage: int, stages: int) -> str:
    return SINGLE if stages == 1 else f"model-{stage + 1:05d}-of-{stages:05d}.safetensors"


def partial_directory(out: Path) -> Path:
    return out.with_name(f".{out.name}.partial")


def publish(partial: Path, out: Path) -> Path:
    """Fsync the files, then rename ``partial`` to ``out`` (replacing an older ``out``)."""
    for file in partial.iterdir():
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    if out.exists():
        shutil.rmtree(out)
    os.replace(partial, out)
    return out


def write_model(model: nn.Module, state: dict[str, torch.Tensor], out: Path) -> Path:
    """Write the whole unsplit ``state`` of ``model`` (one process: ``plait export``)."""
    out = Path(out)
    partial = partial_directory(out)
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    write_safetensors(partial / SINGLE, tensors_to_write(model, state))
    copy_side_files(model, partial)
    return publish(partial, out)
