"""``plait export <run or checkpoint dir> [out=FILE]``: write the consolidated, unsplit fp32
``state_dict`` of a checkpoint, loadable by the plain model (``model.load_state_dict``).

Runs offline in one process: the strategy that wrote the checkpoint reads each pipeline stage's
tensor-parallel shards (joining data-parallel / ZeRO shards), the tensor-parallel plugin joins
those, and the stages' disjoint parameter names are united here.
"""

from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import OmegaConf

from plait.plugin_manager import keep_selected, make_plugin_manager


def export(checkpoint_path: str, out: str | None = None) -> Path:
    found = None
    for candidate in (Path(checkpoint_path), *Path(checkpoint_path).parents):
        if (candidate / "config.yaml").exists():
            found = candidate / "config.yaml"
            break
    if found is None:
        raise ValueError(f"{checkpoint_path}: no config.yaml in it or above it; give a plait run "
                         "directory or a checkpoint directory inside one")
    cfg = OmegaConf.load(found)
    pm = keep_selected(make_plugin_manager(cfg), cfg)
    checkpoint = pm.hook.plait_find_checkpoint(cfg=cfg, path=checkpoint_path)
    if checkpoint is None:
        raise ValueError(f"{checkpoint_path}: no checkpoint found; train with fault=checkpoint")
    shards = pm.hook.plait_read_model_shards(cfg=cfg, checkpoint=checkpoint)
    with torch.device("meta"):
        model = pm.hook.plait_build_model(cfg=cfg)
    state: dict[str, torch.Tensor] = {}
    for pp_rank in sorted({pp for pp, _ in shards}):
        stage = [shards[(pp_rank, tp)] for tp in sorted(tp for pp, tp in shards if pp == pp_rank)]
        merged = pm.hook.plait_merge_tensor_parallel_shards(cfg=cfg, shards=stage, model=model)
        if merged is None:
            if len(stage) > 1:
                raise ValueError(f"{checkpoint}: {len(stage)} tensor-parallel shards but no "
                                 "active plugin merges them")
            merged = stage[0]
        state.update(merged)
    target = Path(out) if out else checkpoint / "consolidated.pt"
    torch.save(state, target)
    return target


def cmd_export(args: list[str]) -> int:
    paths = [a for a in args if not a.startswith("out=")]
    outs = [a.split("=", 1)[1] for a in args if a.startswith("out=")]
    if len(paths) != 1:
        raise ValueError("usage: plait export <run dir | checkpoint dir> [out=FILE]")
    target = export(paths[0], outs[0] if outs else None)
    print(f"plait: wrote {target}")
    return 0
