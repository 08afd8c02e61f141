"""``plait export <run or checkpoint dir> [format=pt|hf] [out=PATH]``: write the consolidated,
unsplit model of a checkpoint.

``format=pt`` (the default) is an fp32 ``state_dict`` (``torch.save``), loadable by the plain
model (``model.load_state_dict``); any other format is written by the plugin that knows it
(``plait_export_model``: ``format=hf`` gives Hugging Face safetensors with the config and the
tokenizer files, for ``model=hf``).

Runs offline in one process: the strategy that wrote the checkpoint reads each pipeline stage's
tensor-parallel shards (joining data-parallel / ZeRO shards), the tensor-parallel plugin joins
those, and the stages' disjoint parameter names are united here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from plait.meta import meta_device
from plait.plugin_manager import PlaitPluginManager, keep_selected, make_plugin_manager


@dataclass
class Consolidated:
    """A checkpoint's run config, its plugins, where it is, the unsplit model on the meta device
    and its full fp32 state by the unsplit names."""

    cfg: DictConfig
    pm: PlaitPluginManager
    checkpoint: Path
    model: torch.nn.Module
    state: dict[str, torch.Tensor]


def run_config(checkpoint_path: str) -> DictConfig:
    for candidate in (Path(checkpoint_path), *Path(checkpoint_path).parents):
        if (candidate / "config.yaml").exists():
            cfg = OmegaConf.load(candidate / "config.yaml")
            assert isinstance(cfg, DictConfig), candidate  # a run's config is a mapping
            return cfg
    raise ValueError(
        f"{checkpoint_path}: no config.yaml in it or above it; give a plait run "
        "directory or a checkpoint directory inside one"
    )


def consolidate(checkpoint_path: str) -> Consolidated:
    """Read a checkpoint's model, every shard joined."""
    cfg = run_config(checkpoint_path)
    pm = keep_selected(make_plugin_manager(cfg), cfg)
    checkpoint = pm.hook.plait_find_checkpoint(cfg=cfg, path=checkpoint_path)
    if checkpoint is None:
        raise ValueError(f"{checkpoint_path}: no checkpoint found; train with fault=checkpoint")
    shards = pm.hook.plait_read_model_shards(cfg=cfg, checkpoint=checkpoint)
    if shards is None:
        raise ValueError(
            f"{checkpoint}: no active plugin reads the checkpoints of strategy="
            f"{cfg.strategy.name} offline (plait_read_model_shards), so it cannot "
            "be exported or sampled from"
        )
    with meta_device():
        model = pm.hook.plait_build_model(cfg=cfg)
    state: dict[str, torch.Tensor] = {}
    for pp_rank in sorted({pp for pp, _ in shards}):
        stage = [shards[(pp_rank, tp)] for tp in sorted(tp for pp, tp in shards if pp == pp_rank)]
        merged = pm.hook.plait_merge_tensor_parallel_shards(cfg=cfg, shards=stage, model=model)
        if merged is None:
            if len(stage) > 1:
                raise ValueError(
                    f"{checkpoint}: {len(stage)} tensor-parallel shards but no "
                    "active plugin merges them"
                )
            merged = stage[0]
        state.update(merged)
    return Consolidated(cfg, pm, checkpoint, model, state)


def export(checkpoint_path: str, out: str | None = None, format: str = "pt") -> Path:
    found = consolidate(checkpoint_path)
    if format == "pt":
        target = Path(out) if out else found.checkpoint / "consolidated.pt"
        torch.save(found.state, target)
        return target
    target = Path(out) if out else found.checkpoint / f"consolidated_{format}"
    written = found.pm.hook.plait_export_model(
        cfg=found.cfg, state_dict=found.state, model=found.model, format=format, out=target
    )
    if written is None:
        raise ValueError(
            f"format={format}: no active plugin writes it; choose format=pt or a "
            "format of the run's model (format=hf for model=hf)"
        )
    return written


def cmd_export(args: list[str]) -> int:
    settings = dict(
        a.split("=", 1) for a in args if "=" in a and a.split("=", 1)[0] in ("out", "format")
    )
    paths = [a for a in args if a.split("=", 1)[0] not in ("out", "format")]
    if len(paths) != 1:
        raise ValueError("usage: plait export <run dir | checkpoint dir> [format=pt|hf] [out=PATH]")
    target = export(paths[0], settings.get("out"), settings.get("format", "pt"))
    print(f"plait: wrote {target}")
    return 0
