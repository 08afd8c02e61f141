"""``checkpoint=default`` (the default): periodic checkpoints that a failed run cannot corrupt,
``resume=auto|latest|<path>``, auto-resume after a restart.

A checkpoint is a directory ``run.dir/checkpoints/step_<n>`` written into ``.step_<n>.partial``:
every rank writes its part, each node fsyncs what it sees, then rank 0 writes ``complete.json``
(every file's size) and renames the directory into place; ``latest`` is replaced by rename after
that. Only a directory whose ``complete.json`` matches its files is ever loaded; a damaged or
partial one is skipped with a message, and the newest complete one is used. ``latest`` never
names a missing checkpoint: re-saving a step that exists (after resuming from an older one)
first points ``latest`` elsewhere. Stale ``.partial`` directories of crashed writes are removed
by the next save.

With ``checkpoint.local_dir`` each node keeps its part of every checkpoint on its own disk, and
with ``checkpoint.replicas=R`` also on R peer nodes (``replication.py``). With
``checkpoint.hf_every=N`` a copy of the model in Hugging Face's format is written every N steps
by the plugin that provides ``model:hf_format`` (``plait_save_model_copy``).

``resume=`` a checkpoint outside this run's directory (another run's, or a copy a PBT sweeper
made) starts a new run from it: weights, optimizer state and data position are loaded, the
other run's tracker id is not (``TrainState.parent`` names that run instead).

This file holds the plugin's settings and hooks; beside it: ``directory.py`` (where checkpoints
live, which are complete, atomic publishing), ``rng.py`` (each rank's random state),
``save_load.py`` (what each rank writes and reads), ``checks.py`` (refusals before launch),
``background.py`` (``checkpoint.async_save``), ``replication.py`` (``checkpoint.replicas``); the
layout-free DCP copy any layout loads is the engine library's (``plait.engine.layout_free``).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from plait import hookimpl
from plait.config import AT_LEAST_0, CheckpointConfig, Range, range_problems
from plait.plugin_manager import offered_by, provided
from plait.plugins.checkpoint import replication
from plait.plugins.checkpoint.checks import (
    RESHARDABLE,
    reshard_problems,
    resume_problems,
    storage_problems,
)
from plait.plugins.checkpoint.directory import newest_visible, node_root, resolve_resume
from plait.plugins.checkpoint.save_load import load, save_if_due
from plait.types import PluginInfo, TrainState


@dataclass
class PlaitCheckpointConfig(CheckpointConfig):
    name: str = "default"
    every: int = 0  # steps between checkpoints; 0: only at the end
    keep_last: int = 2  # complete checkpoints kept; 0 keeps all
    save_final: bool = True
    # copy to CPU memory, write in the background (DCP async_save); publish when written
    async_save: bool = False
    # A directory on each node's own disk: node k keeps its part of every checkpoint in
    # <local_dir>/<run.name>/node<k>. None: every node writes into run.dir/checkpoints (shared).
    local_dir: Optional[str] = None
    replicas: int = 0  # peer nodes that also keep each node's part (needs local_dir)
    # steps between copies of the model in Hugging Face's format (run.dir/hf/step_<n>, and after
    # the last step), written by the plugin that provides model:hf_format; 0: never
    hf_every: int = 0


# Where these settings were before hook spec 1.5 (fault.*), kept working through 1.6.
RENAMED = {
    f"fault.{old}": f"checkpoint.{new}"
    for old, new in (
        ("checkpoint_every", "every"),
        ("keep_last", "keep_last"),
        ("save_final", "save_final"),
        ("async_save", "async_save"),
        ("local_dir", "local_dir"),
        ("replicas", "replicas"),
    )
}
RENAMED["checkpoint=hf"] = "checkpoint=default"  # the group's option (conf/checkpoint/hf.yaml)
HF_FORMAT = "model:hf_format"


RANGES = {
    "every": Range(0, meaning="0: only at the end"),
    "keep_last": Range(0, meaning="0 keeps all"),
    "replicas": AT_LEAST_0,
    "hf_every": Range(0, meaning="0: never"),
}


@hookimpl
def plait_declare() -> PluginInfo:
    return PluginInfo(
        name="checkpoint",
        selected_by={"checkpoint.name": "default"},
        renamed=RENAMED,
        description="atomic periodic checkpoints, resume, auto-resume on restart, "
        "Hugging Face copies (checkpoint.hf_every)",
        # the layout-free state's writer, and the fsspec storage it imports at each save and load
        preload=frozenset(
            {"torch.distributed.checkpoint", "torch.distributed.checkpoint._fsspec_filesystem"}
        ),
    )


@hookimpl
def plait_register_configs(config_store) -> None:
    config_store.store(group="checkpoint", name="base_plait_checkpoint", node=PlaitCheckpointConfig)


@hookimpl
def plait_validate(cfg, dims, hook) -> list[str]:
    problems = range_problems("checkpoint", cfg.checkpoint, RANGES) + resume_problems(cfg)
    reshardable = RESHARDABLE in provided(hook)
    if cfg.checkpoint.async_save and not reshardable:
        problems.append(
            f"checkpoint.async_save=true: strategy={cfg.strategy.name} cannot write "
            f"the layout-free (DCP) state that is saved in the background; use "
            f"{offered_by(RESHARDABLE)}, or checkpoint.async_save=false"
        )
    problems += hf_copy_problems(cfg, hook, reshardable)
    problems += storage_problems(cfg, dims, hook)
    if dims.elastic and not reshardable:
        problems.append(
            f"launcher.nnodes={cfg.launcher.nnodes}: a job that changes size resumes "
            "its checkpoint at another dp, through the layout-free (DCP) copy, which "
            f"strategy={cfg.strategy.name} cannot write; use "
            f"{offered_by(RESHARDABLE)}, or a fixed launcher.nnodes"
        )
    if not problems:
        problems += reshard_problems(cfg, dims, hook, reshardable)
    return problems


@hookimpl
def plait_backend_config(cfg, dims) -> dict:
    """``plait plan`` shows where each node's checkpoint part and its replicas live."""
    if cfg.checkpoint.local_dir is None:
        return {}
    where = {
        "each node's own directory": str(node_root(cfg, 0).parent / "node<k>"),
        **replication.placement(dims.nnodes, min(cfg.checkpoint.replicas, dims.nnodes - 1)),
    }
    return {"checkpoint storage (checkpoint.local_dir, checkpoint.replicas)": where}


@hookimpl
def plait_find_checkpoint(cfg, path) -> Path | None:
    return resolve_resume(cfg, path)


@hookimpl
def plait_load_checkpoint(cfg, engine, topology, hook) -> TrainState | None:
    return load(cfg, engine, topology, reshardable=RESHARDABLE in provided(hook))


@hookimpl
def plait_save_checkpoint(cfg, engine, state, topology, final, hook) -> Path | None:
    written = save_if_due(
        cfg, engine, state, topology, final, reshardable=RESHARDABLE in provided(hook)
    )
    every = cfg.checkpoint.hf_every
    if every and (state.step % every == 0 or final):
        copy = hook.plait_save_model_copy(
            cfg=cfg, engine=engine, topology=topology, step=state.step, format="hf", hook=hook
        )
        if topology.is_logging_rank:
            print(f"plait: wrote {copy} (Hugging Face format)", flush=True)
    return written


def hf_copy_problems(cfg, hook, reshardable: bool) -> list[str]:
    """``checkpoint.hf_every`` needs a plugin that writes the model in Hugging Face's format
    (``model:hf_format``) and an engine that hands over its state by name."""
    every = cfg.checkpoint.hf_every
    if not every:
        return []
    problems = []
    if HF_FORMAT not in provided(hook):
        problems.append(
            f"checkpoint.hf_every={every} writes Hugging Face's format, which needs a "
            f"transformers model ({offered_by(HF_FORMAT)}), not model._target_="
            f"{cfg.model._target_}: set checkpoint.hf_every=0"
        )
    if not reshardable:
        problems.append(
            f"checkpoint.hf_every={every}: strategy={cfg.strategy.name} cannot hand "
            f"over its model state by name ({RESHARDABLE}): use "
            f"{offered_by(RESHARDABLE)}, or set checkpoint.hf_every=0"
        )
    return problems


@hookimpl
def plait_on_failure(cfg, error, state) -> None:
    last = newest_visible(cfg)
    where = f"last good checkpoint: {last}" if last else "no checkpoint was written"
    print(
        f"plait: worker failed at step {state.step} ({type(error).__name__}: {error}); {where}",
        file=sys.stderr,
        flush=True,
    )
