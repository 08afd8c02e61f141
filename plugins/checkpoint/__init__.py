"""``fault=checkpoint`` (the default): periodic atomic checkpoints, ``resume=``, auto-resume after
an elastic restart.

Layout under ``run.dir/checkpoints``::

    step_00000040/            one directory per checkpoint (engine files + trainer_state.json
                              + rng_rank<r>.pt)
    latest                    the name of the newest complete checkpoint

A checkpoint is written into ``.step_<n>.partial`` and renamed into place only after every rank
has finished writing; ``latest`` is replaced by rename too. A crash at any point leaves the
previous checkpoint and ``latest`` untouched.

``resume=`` a checkpoint outside this run's directory (another run's, or a copy a PBT sweeper
made) starts a new run from it: weights, optimizer state and data position are loaded, the
other run's tracker id is not (``TrainState.parent`` names that run instead).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from plait import hookimpl
from plait.config import FaultConfig, Range, range_problems
from plait.types import PluginInfo, TrainState

LATEST = "latest"
TRAINER_STATE = "trainer_state.json"


@dataclass
class CheckpointConfig(FaultConfig):
    name: str = "checkpoint"
    checkpoint_every: int = 0  # steps between checkpoints; 0: only at the end
    keep_last: int = 2  # complete checkpoints kept; 0 keeps all
    save_final: bool = True


RANGES = {"checkpoint_every": Range(0, meaning="0: only at the end"),
          "keep_last": Range(0, meaning="0 keeps all")}


def checkpoint_root(cfg) -> Path:
    return Path(cfg.run.dir) / "checkpoints"


def latest_checkpoint(root: Path) -> Path | None:
    pointer = root / LATEST
    if not pointer.exists():
        return None
    return root / pointer.read_text().strip()


def resolve_resume(cfg, resume: str | None) -> Path | None:
    """The checkpoint directory to resume from, or None for a fresh start.

    ``latest`` means the newest checkpoint of this run directory; a path may name a checkpoint
    directory or a run directory (its newest checkpoint is used). After an elastic restart
    (``TORCHELASTIC_RESTART_COUNT > 0``) the newest checkpoint is used automatically.
    """
    if resume is None:
        restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0
        return latest_checkpoint(checkpoint_root(cfg)) if restarted else None
    if resume == LATEST:
        return latest_checkpoint(checkpoint_root(cfg))
    path = Path(resume).expanduser()
    if (path / TRAINER_STATE).exists():
        return path
    for root in (path / "checkpoints", path):
        found = latest_checkpoint(root)
        if found is not None:
            return found
    return None


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def prune(root: Path, keep_last: int) -> None:
    if keep_last <= 0:
        return
    complete = sorted(p for p in root.glob("step_*") if (p / TRAINER_STATE).exists())
    for old in complete[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


@hookimpl
def plait_declare() -> PluginInfo:
    return PluginInfo(name="checkpoint", selected_by={"fault.name": "checkpoint"},
                      description="atomic periodic checkpoints, resume, auto-resume on restart")


@hookimpl
def plait_register_configs(config_store) -> None:
    config_store.store(group="fault", name="base_checkpoint", node=CheckpointConfig)


@hookimpl
def plait_validate(cfg) -> list[str]:
    return range_problems("fault", cfg.fault, RANGES) + resume_problems(cfg)


def resume_problems(cfg) -> list[str]:
    root = checkpoint_root(cfg)
    if cfg.resume is not None:
        if resolve_resume(cfg, cfg.resume) is None:
            where = root if cfg.resume == LATEST else cfg.resume
            return [f"resume={cfg.resume}: no checkpoint found in {where}; start without "
                    "resume=, or give a checkpoint or run directory that holds one"]
        return []
    existing = latest_checkpoint(root)
    if existing is not None:
        return [f"run.dir={cfg.run.dir} already holds checkpoints (latest: {existing.name}); "
                "continue it with resume=latest, or start a new run with another run.name"]
    return []


@hookimpl
def plait_find_checkpoint(cfg, path) -> Path | None:
    return resolve_resume(cfg, path)


@hookimpl
def plait_load_checkpoint(cfg, engine, topology) -> TrainState | None:
    path = resolve_resume(cfg, cfg.resume)
    if path is None:
        return None
    engine.load_state(path)
    rng_file = path / f"rng_rank{topology.rank}.pt"
    if rng_file.exists():
        torch.set_rng_state(torch.load(rng_file, weights_only=True))
    state = TrainState.from_dict(json.loads((path / TRAINER_STATE).read_text()))
    if not path.resolve().is_relative_to(checkpoint_root(cfg).resolve()):
        state = fork(state, path)
    if topology.is_logging_rank:
        print(f"plait: resumed from {path} at step {state.step}", flush=True)
    return state


def fork(state: TrainState, path: Path) -> TrainState:
    """Another run's checkpoint starts a new run: its weights, optimizer and data position are
    taken, its tracker run is not (the new run gets its own and names the other as parent)."""
    state.parent = {"run_name": state.run_name, "tracker_run_id": state.tracker_run_id,
                    "step": state.step, "checkpoint": str(path)}
    state.tracker_run_id, state.run_name, state.metrics = None, None, {}
    return state


@hookimpl
def plait_save_checkpoint(cfg, engine, state, topology, final) -> Path | None:
    every = cfg.fault.checkpoint_every
    due = (final and cfg.fault.save_final) or (every > 0 and state.step % every == 0)
    if not due:
        return None
    root = checkpoint_root(cfg)
    name = f"step_{state.step:08d}"
    partial, complete = root / f".{name}.partial", root / name
    if topology.rank == 0:
        shutil.rmtree(partial, ignore_errors=True)  # left over from a crashed write
        partial.mkdir(parents=True)
    barrier()
    engine.save_state(partial)
    torch.save(torch.get_rng_state(), partial / f"rng_rank{topology.rank}.pt")
    barrier()
    if topology.rank == 0:
        state.run_name = cfg.run.name
        atomic_write_text(partial / TRAINER_STATE, json.dumps(state.to_dict()))
        if complete.exists():  # the same step saved again after a resume: same content
            shutil.rmtree(complete)
        os.replace(partial, complete)
        atomic_write_text(root / LATEST, name)
        prune(root, cfg.fault.keep_last)
    barrier()
    return complete


@hookimpl
def plait_on_failure(cfg, error, state) -> None:
    last = latest_checkpoint(checkpoint_root(cfg))
    where = f"last good checkpoint: {last}" if last else "no checkpoint was written"
    print(f"plait: worker failed at step {state.step} ({type(error).__name__}: {error}); {where}",
          file=sys.stderr, flush=True)
