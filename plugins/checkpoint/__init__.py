"""``fault=checkpoint`` (the default): periodic checkpoints that a failed run cannot corrupt,
``resume=auto|latest|<path>``, auto-resume after a restart.

A checkpoint is a directory ``run.dir/checkpoints/step_<n>`` written into ``.step_<n>.partial``:
every rank writes its part, each node fsyncs what it sees, then rank 0 writes ``complete.json``
(every file's size) and renames the directory into place; ``latest`` is replaced by rename after
that. Only a directory whose ``complete.json`` matches its files is ever loaded; a damaged or
partial one is skipped with a message, and the newest complete one is used. ``latest`` never
names a missing checkpoint: re-saving a step that exists (after resuming from an older one)
first points ``latest`` elsewhere. Stale ``.partial`` directories of crashed writes are removed
by the next save.

With ``fault.local_dir`` each node keeps its part of every checkpoint on its own disk, and with
``fault.replicas=R`` also on R peer nodes (``replication.py``).

``resume=`` a checkpoint outside this run's directory (another run's, or a copy a PBT sweeper
made) starts a new run from it: weights, optimizer state and data position are loaded, the
other run's tracker id is not (``TrainState.parent`` names that run instead).

This file holds the plugin's settings and hooks; beside it: ``directory.py`` (where checkpoints
live, which are complete, atomic publishing), ``rng.py`` (each rank's random state),
``save_load.py`` (what each rank writes and reads), ``checks.py`` (refusals before launch),
``layout_free.py`` (the DCP copy any layout loads), ``background.py`` (``fault.async_save``),
``replication.py`` (``fault.replicas``).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from plait import hookimpl
from plait.config import AT_LEAST_0, FaultConfig, Range, range_problems
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
class CheckpointConfig(FaultConfig):
    name: str = "checkpoint"
    checkpoint_every: int = 0  # steps between checkpoints; 0: only at the end
    keep_last: int = 2  # complete checkpoints kept; 0 keeps all
    save_final: bool = True
    # The step guard (plait.plugins.fault) of this option:
    max_bad_steps: int = 3  # consecutive skipped (non-finite, spiked) steps ending the attempt
    spike_factor: float = 0.0  # skip a step whose loss is above this x the running median; 0: off
    # The straggler detector and the collective watchdog (plait.plugins.fault, docs/fault.md):
    # name a rank whose compute time is this x the median of the others' over the window of
    # logged steps (0: off, with the per-rank phase timing); warn, or exclude its node
    straggler_factor: float = 1.5
    straggler_window: int = 5
    straggler_action: str = "warn"  # warn | exclude (an elastic job: launcher.nnodes=MIN:MAX)
    # every process group's timeout, and a heartbeat that names the rank that did not arrive
    collective_timeout_s: Optional[float] = None  # None: off
    # copy to CPU memory, write in the background (DCP async_save); publish when written
    async_save: bool = False
    # A directory on each node's own disk: node k keeps its part of every checkpoint in
    # <local_dir>/<run.name>/node<k>. None: every node writes into run.dir/checkpoints (shared).
    local_dir: Optional[str] = None
    replicas: int = 0  # peer nodes that also keep each node's part (needs local_dir)


RANGES = {"checkpoint_every": Range(0, meaning="0: only at the end"),
          "keep_last": Range(0, meaning="0 keeps all"), "replicas": AT_LEAST_0}


@hookimpl
def plait_declare() -> PluginInfo:
    return PluginInfo(name="checkpoint", selected_by={"fault.name": "checkpoint"},
                      description="atomic periodic checkpoints, resume, auto-resume on restart")


@hookimpl
def plait_register_configs(config_store) -> None:
    config_store.store(group="fault", name="base_checkpoint", node=CheckpointConfig)


@hookimpl
def plait_validate(cfg, dims, hook) -> list[str]:
    problems = range_problems("fault", cfg.fault, RANGES) + resume_problems(cfg)
    reshardable = RESHARDABLE in provided(hook)
    if cfg.fault.async_save and not reshardable:
        problems.append(f"fault.async_save=true: strategy={cfg.strategy.name} cannot write the "
                        f"layout-free (DCP) state that is saved in the background; use "
                        f"{offered_by(RESHARDABLE)}, or fault.async_save=false")
    problems += storage_problems(cfg, dims, hook)
    if dims.elastic and not reshardable:
        problems.append(f"launcher.nnodes={cfg.launcher.nnodes}: a job that changes size resumes "
                        "its checkpoint at another dp, through the layout-free (DCP) copy, which "
                        f"strategy={cfg.strategy.name} cannot write; use "
                        f"{offered_by(RESHARDABLE)}, or a fixed launcher.nnodes")
    if not problems:
        problems += reshard_problems(cfg, dims, hook, reshardable)
    return problems


@hookimpl
def plait_backend_config(cfg, dims) -> dict:
    """``plait plan`` shows where each node's checkpoint part and its replicas live."""
    if cfg.fault.local_dir is None:
        return {}
    where = {"each node's own directory": str(node_root(cfg, 0).parent / "node<k>"),
             **replication.placement(dims.nnodes, min(cfg.fault.replicas, dims.nnodes - 1))}
    return {"checkpoint storage (fault.local_dir, fault.replicas)": where}


@hookimpl
def plait_find_checkpoint(cfg, path) -> Path | None:
    return resolve_resume(cfg, path)


@hookimpl
def plait_load_checkpoint(cfg, engine, topology, hook) -> TrainState | None:
    return load(cfg, engine, topology, reshardable=RESHARDABLE in provided(hook))


@hookimpl
def plait_save_checkpoint(cfg, engine, state, topology, final, hook) -> Path | None:
    return save_if_due(cfg, engine, state, topology, final,
                       reshardable=RESHARDABLE in provided(hook))


@hookimpl
def plait_on_failure(cfg, error, state) -> None:
    last = newest_visible(cfg)
    where = f"last good checkpoint: {last}" if last else "no checkpoint was written"
    print(f"plait: worker failed at step {state.step} ({type(error).__name__}: {error}); {where}",
          file=sys.stderr, flush=True)
