"""``fault=checkpoint`` (the default): periodic checkpoints that a failed run cannot corrupt,
``resume=auto|latest|<path>``, auto-resume after a restart.

Layout under ``run.dir/checkpoints``::

    step_00000040/            one directory per checkpoint: engine files, trainer_state.json,
                              rng_rank<r>.pt, and complete.json (written last)
    latest                    the name of the newest complete checkpoint (for people and tools)

A checkpoint is written into ``.step_<n>.partial``: every rank writes its part, each node fsyncs
what it sees, then rank 0 writes ``complete.json`` (every file's size) and renames the directory
into place; ``latest`` is replaced by rename after that. Only a directory whose ``complete.json``
matches its files is ever loaded; a damaged or partial one is skipped with a message, and the
newest complete one is used. ``latest`` never names a missing checkpoint: re-saving a step that
exists (after resuming from an older one) first points ``latest`` elsewhere. Stale ``.partial``
directories of crashed writes are removed by the next save.

With ``fault.local_dir`` each node keeps its part of every checkpoint on its own disk, and with
``fault.replicas=R`` also on R peer nodes (``replication.py``).

``resume=`` a checkpoint outside this run's directory (another run's, or a copy a PBT sweeper
made) starts a new run from it: weights, optimizer state and data position are loaded, the
other run's tracker id is not (``TrainState.parent`` names that run instead).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from plait import hookimpl
from plait.config import AT_LEAST_0, FaultConfig, Range, node_range, range_problems
from plait.meta import meta_model
from plait.plugins.checkpoint import layout_free, replication
from plait.plugins.checkpoint.background import BackgroundWrites
from plait.types import PluginInfo, TrainState

LATEST = "latest"
AUTO = "auto"
TRAINER_STATE = "trainer_state.json"
COMPLETE = "complete.json"
LAYOUT = "layout.json"
RESHARDABLE = "engine:layout_free_state"
background = BackgroundWrites()


@dataclass
class CheckpointConfig(FaultConfig):
    name: str = "checkpoint"
    checkpoint_every: int = 0  # steps between checkpoints; 0: only at the end
    keep_last: int = 2  # complete checkpoints kept; 0 keeps all
    save_final: bool = True
    # The step guard (plait.plugins.fault) of this option:
    max_bad_steps: int = 3  # consecutive skipped (non-finite, spiked) steps ending the attempt
    spike_factor: float = 0.0  # skip a step whose loss is above this x the running median; 0: off
    # copy to CPU memory, write in the background (DCP async_save); publish when written
    async_save: bool = False
    # A directory on each node's own disk: node k keeps its part of every checkpoint in
    # <local_dir>/<run.name>/node<k>. None: every node writes into run.dir/checkpoints (shared).
    local_dir: Optional[str] = None
    replicas: int = 0  # peer nodes that also keep each node's part (needs local_dir)


RANGES = {"checkpoint_every": Range(0, meaning="0: only at the end"),
          "keep_last": Range(0, meaning="0 keeps all"), "replicas": AT_LEAST_0}


def checkpoint_root(cfg, node: int | None = None) -> Path:
    """Where checkpoints are written: the run directory's, or node ``node``'s own."""
    if cfg.fault.local_dir is None:
        return Path(cfg.run.dir) / "checkpoints"
    return replication.node_root(cfg, node)


def visible_roots(cfg) -> list[Path]:
    """The checkpoint roots this machine sees before launch (node-local: every node root on
    it, for the checks that need no processes)."""
    if cfg.fault.local_dir is None:
        return [checkpoint_root(cfg)]
    return sorted(replication.node_root(cfg, 0).parent.glob("node*"))


def newest_visible(cfg) -> Path | None:
    """The newest complete checkpoint on this machine; node-local: one that holds the run's own
    files (node 0's part: ``layout.json``, ``trainer_state.json``)."""
    if cfg.fault.local_dir is None:
        return latest_checkpoint(checkpoint_root(cfg), quiet=True)
    found = [c for root in visible_roots(cfg) if (c := latest_checkpoint(root, quiet=True))
             and (c / TRAINER_STATE).exists()]
    return max(found, key=lambda path: path.name, default=None)


def checkpoint_problem(path: Path) -> str | None:
    """Why ``path`` is not a complete checkpoint (partial, damaged), or None when it is."""
    try:
        files = json.loads((path / COMPLETE).read_text())["files"]
    except FileNotFoundError:
        return f"no {COMPLETE} (an unfinished write)"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"unreadable {COMPLETE} ({e})"
    for name, size in files.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != size:
            return f"{name} has {file.stat().st_size} bytes, {COMPLETE} says {size}"
    return None


def latest_checkpoint(root: Path, quiet: bool = False) -> Path | None:
    """The newest complete checkpoint under ``root``; damaged or partial ones are skipped with a
    message on stderr."""
    for path in sorted(root.glob("step_*"), reverse=True):
        problem = checkpoint_problem(path)
        if problem is None:
            return path
        if not quiet:
            print(f"plait: skipping checkpoint {path}: {problem}", file=sys.stderr, flush=True)
    return None


def restarted() -> bool:
    """This process is a restart: by torch elastic (plait's launcher, torchrun) or SLURM."""
    return any(int(os.environ.get(v, 0)) > 0
               for v in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"))


def resolve_resume(cfg, resume: str | None) -> Path | None:
    """The checkpoint directory to resume from, or None for a fresh start.

    ``auto``: this run directory's newest complete checkpoint, else a fresh start. ``latest``:
    the same, but there must be one. A path names a checkpoint directory or a run directory (its
    newest complete checkpoint). A restarted process (torch elastic, a SLURM requeue) always
    continues from this run's own newest checkpoint when there is one.
    """
    own = newest_visible(cfg) if cfg.fault.local_dir else latest_checkpoint(checkpoint_root(cfg))
    if resume in (AUTO, LATEST) or (restarted() and own is not None):
        return own
    if resume is None:
        return None
    path = Path(resume).expanduser()
    if (path / COMPLETE).exists() or (path / TRAINER_STATE).exists():
        problem = checkpoint_problem(path)
        if problem is not None:
            raise ValueError(f"resume={resume}: not a complete checkpoint: {problem}; give "
                             "another checkpoint, or the run directory for its newest "
                             "complete one")
        return path
    for root in (path / "checkpoints", path):
        found = latest_checkpoint(root)
        if found is not None:
            return found
    return None


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def barrier(topology) -> None:
    """Wait for every trainer (the ranks that save; other roles save their own state). Trainers
    that go at their own pace do not meet: the first of them writes the checkpoint alone."""
    if dist.is_initialized() and topology.roles.lockstep:
        dist.barrier(group=topology.trainer_group)


def prune(root: Path, keep_last: int) -> None:
    if keep_last <= 0:
        return
    complete = sorted(p for p in root.glob("step_*") if checkpoint_problem(p) is None)
    for old in complete[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def remove_leftovers(root: Path) -> None:
    """Directories of writes that never finished (the writer crashed)."""
    for stale in [*root.glob(".step_*.partial"), *root.glob(".step_*.replaced")]:
        shutil.rmtree(stale, ignore_errors=True)


def publish(root: Path, partial: Path, name: str) -> Path:
    """Write the completion marker last, rename ``partial`` to ``name`` and point ``latest`` at
    it. ``latest`` names a complete checkpoint at every instant, even when ``name`` exists
    (the same step saved again after resuming from an older checkpoint)."""
    files = {str(f.relative_to(partial)): f.stat().st_size
             for f in sorted(partial.rglob("*")) if f.is_file()}
    atomic_write_text(partial / COMPLETE, json.dumps({"files": files}))
    complete = root / name
    if complete.exists():
        others = [p for p in sorted(root.glob("step_*")) if p != complete
                  and checkpoint_problem(p) is None]
        if others:
            atomic_write_text(root / LATEST, others[-1].name)
        else:
            (root / LATEST).unlink(missing_ok=True)
        replaced = root / f".{name}.replaced"
        os.replace(complete, replaced)
        os.replace(partial, complete)
        shutil.rmtree(replaced)
    else:
        os.replace(partial, complete)
    fsync_path(root)
    atomic_write_text(root / LATEST, name)
    return complete


def rng_state() -> dict:
    """Every random generator the next step may draw from, for this rank."""
    _, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": (torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state) -> None:
    if isinstance(state, torch.Tensor):  # checkpoints before every generator was saved
        torch.set_rng_state(state)
        return
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state(("MT19937", keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


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
    reshardable = any(RESHARDABLE in info.provides for info in hook.plait_declare())
    if cfg.fault.async_save and not reshardable:
        problems.append(f"fault.async_save=true: strategy={cfg.strategy.name} cannot write the "
                        "layout-free (DCP) state that is saved in the background; use "
                        "strategy=ddp or zero0..zero3, or fault.async_save=false")
    problems += storage_problems(cfg, dims, hook)
    if node_range(cfg.launcher.nnodes).elastic and not reshardable:
        problems.append(f"launcher.nnodes={cfg.launcher.nnodes}: a job that changes size resumes "
                        "its checkpoint at another dp, through the layout-free (DCP) copy, which "
                        f"strategy={cfg.strategy.name} cannot write; use strategy=ddp or "
                        "zero0..zero3, or a fixed launcher.nnodes")
    if not problems:
        problems += reshard_problems(cfg, dims, hook, reshardable)
    return problems


def storage_problems(cfg, dims, hook) -> list[str]:
    """Replicas need node-local checkpoints and fewer replicas than nodes."""
    fault, problems = cfg.fault, []
    if fault.replicas > 0 and fault.local_dir is None:
        problems.append(
            f"fault.replicas={fault.replicas} keeps each node's checkpoint part on peer nodes' "
            f"own disks, but without fault.local_dir every node writes into the shared "
            f"{checkpoint_root(cfg)}, where a copy protects nothing: set fault.local_dir=<a "
            "directory on each node's own disk>, or fault.replicas=0")
    if fault.replicas > 0 and fault.replicas >= dims.nnodes:
        problems.append(
            f"fault.replicas={fault.replicas} with {dims.nnodes} node(s): a node's part is kept "
            f"on fault.replicas other nodes, so it must be below the node count: set "
            f"fault.replicas={dims.nnodes - 1}" + (" (launcher.nnodes=1 has no peer node)"
                                                   if dims.nnodes == 1 else ""))
    if fault.local_dir is not None and fault.async_save:
        problems.append("fault.async_save=true cannot write node-local checkpoints "
                        "(fault.local_dir): set fault.async_save=false, or unset fault.local_dir")
    if fault.local_dir is not None and has_other_roles(cfg, dims, hook):
        problems.append(f"strategy={cfg.strategy.name} runs ranks of other roles (e.g. parameter "
                        "servers) that write their own checkpoint files, which fault.local_dir "
                        "does not place: unset fault.local_dir")
    return problems


def has_other_roles(cfg, dims, hook) -> bool:
    try:
        roles = hook.plait_assign_roles(cfg=cfg, world_size=dims.world_size)
    except ValueError:
        return False
    return roles is not None and not roles.single


@hookimpl
def plait_backend_config(cfg, dims) -> dict:
    """``plait plan`` shows where each node's checkpoint part and its replicas live."""
    if cfg.fault.local_dir is None:
        return {}
    where = {"each node's own directory": str(replication.node_root(cfg, 0).parent / "node<k>"),
             **replication.placement(dims.nnodes, min(cfg.fault.replicas, dims.nnodes - 1))}
    return {"checkpoint storage (fault.local_dir, fault.replicas)": where}


def current_layout(cfg, dims) -> dict:
    return {"strategy": cfg.strategy.name, "dp": dims.dp, "tp": dims.tp, "pp": dims.pp}


def describe(layout: dict) -> str:
    return (f"strategy={layout['strategy']} parallel.dp={layout['dp']} parallel.tp="
            f"{layout['tp']} parallel.pp={layout['pp']}")


def saved_layout(path: Path) -> dict | None:
    """What wrote the checkpoint: its layout and which formats it holds (None: written before
    plait recorded it, engine files only)."""
    try:
        return json.loads((path / LAYOUT).read_text())
    except FileNotFoundError:
        return None


def needs_conversion(saved: dict | None, layout: dict) -> bool:
    """The engine's own files cannot be loaded: another layout wrote them, or there are none."""
    if saved is None:
        return False
    return not saved["engine_files"] or {k: saved[k] for k in layout} != layout


def reshard_problems(cfg, dims, hook, reshardable: bool) -> list[str]:
    """A resume that needs a conversion the checkpoint or the strategy cannot do."""
    if dims is None:
        return []
    path = resolve_resume(cfg, cfg.resume)
    layout = current_layout(cfg, dims)
    saved = saved_layout(path) if path is not None else None
    if not needs_conversion(saved, layout):
        return []
    was = describe(saved)
    if not saved["layout_free"]:
        return [f"resume: checkpoint {path} was written with {was}, which saves no layout-free "
                f"copy, so it cannot be converted to {describe(layout)}: resume with {was}"]
    if not reshardable:
        return [f"resume: checkpoint {path} was written with {was}; strategy="
                f"{cfg.strategy.name} cannot load another layout's checkpoint: resume with {was}, "
                "or with strategy=ddp or zero0..zero3 at any parallel.dp/tp/pp"]
    model = meta_model(hook, cfg)
    if model is None:
        return []
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    stored = layout_free.saved_shapes(path)
    missing = sorted(shapes.keys() - stored.keys())
    resized = [f"{k}: {stored[k]} in the checkpoint, {shapes[k]} in the model"
               for k in sorted(shapes.keys() & stored.keys()) if shapes[k] != stored[k]]
    if missing or resized:
        what = "; ".join(resized[:3] + ([f"{len(missing)} parameters missing, e.g. "
                                         f"{missing[:3]}"] if missing else []))
        return [f"resume: checkpoint {path} holds another model ({what}): resume with the "
                "model._target_ and settings that wrote it, or start fresh with resume=null "
                "and another run.name"]
    return []


def resume_problems(cfg) -> list[str]:
    root = ", ".join(map(str, visible_roots(cfg)))
    if cfg.resume == AUTO or (cfg.resume == LATEST and cfg.fault.local_dir):
        return []  # node-local: the nodes learn what survives when they meet
    if cfg.resume is not None:
        if resolve_resume(cfg, cfg.resume) is None:
            where = root if cfg.resume == LATEST else cfg.resume
            return [f"resume={cfg.resume}: no complete checkpoint found in {where}; start with "
                    "resume=auto (resumes only if there is one), or give a checkpoint or run "
                    "directory that holds one"]
        return []
    existing = newest_visible(cfg)
    if existing is not None and not restarted():
        return [f"run.dir={cfg.run.dir} already holds checkpoints (latest: {existing.name}) and "
                "resume=null starts fresh: continue it with resume=auto, or start a new run "
                "with another run.name"]
    return []


@hookimpl
def plait_find_checkpoint(cfg, path) -> Path | None:
    return resolve_resume(cfg, path)


def checkpoint_to_load(cfg, topology) -> Path | None:
    """The checkpoint this rank loads (every trainer calls this: with node-local checkpoints,
    the nodes agree on it and fetch the parts they lack first)."""
    if cfg.fault.local_dir is None:
        return resolve_resume(cfg, cfg.resume)
    own = None
    if cfg.resume in (AUTO, LATEST) or restarted():
        own = replication.restore(cfg, topology)
    if own is None and cfg.resume == LATEST:
        raise ValueError(f"resume=latest: no node holds a checkpoint of this run under "
                         f"{replication.node_root(cfg, 0).parent}; start with resume=auto")
    if own is None and cfg.resume not in (None, AUTO):
        return resolve_resume(cfg, cfg.resume)  # another run's checkpoint
    return own


@hookimpl
def plait_load_checkpoint(cfg, engine, topology) -> TrainState | None:
    path = checkpoint_to_load(cfg, topology)
    if path is None:
        return None
    saved, layout = saved_layout(path), current_layout(cfg, topology.dims)
    if needs_conversion(saved, layout):
        if topology.is_logging_rank:
            print(f"plait: converting checkpoint {path} from {describe(saved)} to "
                  f"{describe(layout)} (layout-free DCP copy)", flush=True)
        layout_free.load(engine, topology, path, topology.trainer_group)
    else:
        engine.load_state(path)
    rng_file = path / f"rng_rank{topology.rank}.pt"
    if rng_file.exists():
        set_rng_state(torch.load(rng_file, weights_only=True))
    state = TrainState.from_dict(json.loads((path / TRAINER_STATE).read_text()))
    if not path.resolve().is_relative_to(checkpoint_root(cfg, topology.node_rank).resolve()):
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
    if not (topology.roles.lockstep or topology.is_logging_rank):
        return None  # at its own pace: the first trainer's engine saves the run's state
    every = cfg.fault.checkpoint_every
    due = (final and cfg.fault.save_final) or (every > 0 and state.step % every == 0)
    complete = save(cfg, engine, state, topology) if due else None
    if final:
        background.wait()  # the run ends with its last checkpoint published
    return complete


def save(cfg, engine, state, topology) -> Path:
    """Every rank writes its part into ``.step_<n>.partial``; rank 0 publishes it when all
    parts are durable: now, or with ``fault.async_save`` when the background write is done.
    With ``fault.local_dir`` each node writes into its own root and publishes its own
    directory once every node's part and replicas are durable."""
    background.wait()  # the previous write is published before its .partial could be removed
    node_local = cfg.fault.local_dir is not None
    root = checkpoint_root(cfg, topology.node_rank)
    name = f"step_{state.step:08d}"
    partial, complete = root / f".{name}.partial", root / name
    reshardable = hasattr(engine, "layout_free_state")
    in_background = cfg.fault.async_save and reshardable
    makes_directory = (topology.local_trainer_rank == 0) if node_local else topology.is_logging_rank
    if makes_directory:
        remove_leftovers(root)
        partial.mkdir(parents=True)
    barrier(topology)
    if not in_background:
        engine.save_state(partial)
    torch.save(rng_state(), partial / f"rng_rank{topology.rank}.pt")
    record = {**current_layout(cfg, topology.dims), "engine_files": not in_background,
              "layout_free": reshardable}
    state.run_name = cfg.run.name  # a run resumed elsewhere (a PBT copy) names its source
    trainer_state = json.dumps(state.to_dict())

    def write_run_files() -> None:
        atomic_write_text(partial / LAYOUT, json.dumps(record))
        atomic_write_text(partial / TRAINER_STATE, trainer_state)

    def publish_on_rank0() -> None:
        if in_background:  # the writer fsynced its own files; the RNG states were not
            for file in partial.glob("rng_rank*.pt"):
                fsync_path(file)
        write_run_files()
        publish(root, partial, name)
        prune(root, cfg.fault.keep_last)

    publisher = publish_on_rank0 if topology.is_logging_rank else None
    if in_background:
        background.start(lambda stager: layout_free.save(
            engine, topology, partial, background.process_group(topology), stager), publisher)
        return complete
    if reshardable:
        layout_free.save(engine, topology, partial, topology.trainer_group)
    barrier(topology)
    if topology.local_trainer_rank == 0:  # one process per node makes its node's writes durable
        for file in partial.rglob("*"):
            fsync_path(file)
    barrier(topology)
    if node_local:
        if topology.is_logging_rank:  # node 0's part holds the run's own files
            write_run_files()
        replication.replicate(partial, name, topology, cfg.fault.replicas)
        barrier(topology)  # every node's part and replicas are durable: each node publishes
        if topology.local_trainer_rank == 0:
            publish(root, partial, name)
            prune(root, cfg.fault.keep_last)
    elif publisher is not None:
        publisher()
    barrier(topology)
    return complete


@hookimpl
def plait_on_failure(cfg, error, state) -> None:
    last = newest_visible(cfg)
    where = f"last good checkpoint: {last}" if last else "no checkpoint was written"
    print(f"plait: worker failed at step {state.step} ({type(error).__name__}: {error}); {where}",
          file=sys.stderr, flush=True)
