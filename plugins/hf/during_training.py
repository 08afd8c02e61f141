"""``checkpoint.hf_every=N`` (the checkpoint plugin's setting): the model in Hugging Face's format
every ``N`` steps and after the last, from any layout, into ``run.dir/hf/step_<n>``
(``run.dir/hf/latest`` names the newest); ``from_pretrained`` loads each.

The checkpoint plugin asks for it after its own checkpoint at the same step
(``plait_save_model_copy(format="hf")``, on every rank); this plugin answers for a
``transformers`` model. Every rank hands over its model state by the unsplit names (the engine's
``layout_free_state``, capability ``engine:layout_free_state``: data-parallel and ZeRO / FSDP
shards joined), tensor-parallel shards are all-gathered over the tp group, and one rank per
pipeline stage (dp rank 0, tp rank 0) writes that stage's file ``model-<s>-of-<pp>.safetensors``
(under ``parallel.ep`` with every expert, gathered over its expert-parallel group);
rank 0 then writes the index, the config and the tokenizer files and renames the directory into
place. No rank holds more than its stage, and only model weights are written (no optimizer
state, no layout-free copy: about a sixth of a plait checkpoint's bytes; ``scripts/
bench_hf_load.py --saves`` times the two stops).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from plait import hookimpl
from plait.meta import meta_model
from plait.types import PluginInfo


def model_state(engine, topology) -> dict[str, torch.Tensor]:
    """This rank's stage, every tensor full (a collective on every rank)."""
    from plait.engine.layout_free import gather_shard, tensor_parallel_placements

    state = dict(engine.layout_free_state()["model"])
    placements = tensor_parallel_placements(engine)
    for name, local in state.items():
        if name in placements:
            state[name] = gather_shard(local, placements[name], topology)
    return state


def gather_experts(state: dict[str, torch.Tensor], topology, model) -> dict[str, torch.Tensor]:
    """Under ``parallel.ep > 1`` each rank of an expert-parallel group holds its own experts
    (global names): every rank gets all of them (a collective over the ep group), so the stage's
    writer writes every expert once."""
    if topology.dims.ep == 1:
        return state
    prefixes = tuple(
        f"{name}.experts." for name, m in model.named_modules() if getattr(m, "is_moe_layer", False)
    )
    mine = {name: value for name, value in state.items() if name.startswith(prefixes)}
    gathered = [None] * topology.dims.ep
    dist.all_gather_object(
        gathered, {n: v.cpu() for n, v in mine.items()}, group=topology.group("ep")
    )
    for experts in gathered:
        state.update(experts)
    return state


def barrier(topology) -> None:
    if dist.is_initialized():
        dist.barrier(group=topology.trainer_group)


def save(cfg, engine, step: int, topology, model) -> Path:
    from plait.engine.files import atomic_write_text
    from plait.plugins.hf.checkpoint_files import write_safetensors
    from plait.plugins.hf.writer import (
        copy_side_files,
        partial_directory,
        publish,
        stage_file,
        tensors_to_write,
        write_index,
    )

    root = Path(cfg.run.dir) / "hf"
    out = root / f"step_{step:08d}"
    partial = partial_directory(out)
    pp = topology.dims.pp
    state = gather_experts(model_state(engine, topology), topology, model)
    if topology.is_logging_rank:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    barrier(topology)
    if topology.dp_rank == 0 and topology.tp_rank == 0:
        write_safetensors(
            partial / stage_file(topology.pp_rank, pp), tensors_to_write(model, state)
        )
    del state
    barrier(topology)
    if topology.is_logging_rank:
        if pp > 1:
            write_index(partial, [stage_file(s, pp) for s in range(pp)])
        copy_side_files(model, partial)
        publish(partial, out)
        atomic_write_text(root / "latest", out.name)
    barrier(topology)
    return out


class HFCheckpoints:
    """The plugin: writes the copy the checkpoint plugin asks for; the model's config, source
    directory and dtypes come from the model plugin's model on the meta device (no state kept).
    Always active: it answers only for a ``transformers`` model (whose plugin, ``hf`` or
    ``llama``, declares ``model:hf_format``)."""

    @hookimpl
    def plait_declare(self) -> PluginInfo:
        return PluginInfo(
            name="hf_checkpoint",
            description="Hugging Face copies during training (plait_save_model_copy, format hf)",
        )

    @hookimpl
    def plait_save_model_copy(self, cfg, engine, topology, step, format, hook) -> Path | None:
        from plait.plugins.hf.writer import is_transformers_model

        model = meta_model(hook, cfg)
        if format != "hf" or model is None or not is_transformers_model(model):
            return None
        return save(cfg, engine, step, topology, model)


plugin = HFCheckpoints()
