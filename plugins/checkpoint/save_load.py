"""Saving and loading a checkpoint: what every rank writes, who publishes, and how a resume
finds its checkpoint and reads it back (the engine's own files, or the layout-free copy at
another layout). The directory rules are ``directory.py``'s, the random state ``rng.py``'s.

At most one background write (``checkpoint.async_save``) is in flight per worker process;
``background`` holds it from one save to the next.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch.distributed as dist

from plait.engine import layout_free
from plait.engine.files import atomic_write_text, fsync_path
from plait.plugins.checkpoint import replication
from plait.plugins.checkpoint.background import BackgroundWrites
from plait.plugins.checkpoint.directory import (
    AUTO,
    LATEST,
    LAYOUT,
    TRAINER_STATE,
    checkpoint_root,
    node_root,
    prune,
    publish,
    remove_leftovers,
    resolve_resume,
    restarted,
)
from plait.plugins.checkpoint.rng import RNG_FILE, load_rng, save_rng
from plait.types import TrainState

background = BackgroundWrites()


def barrier(topology) -> None:
    """Wait for every trainer (the ranks that save; other roles save their own state). Trainers
    that go at their own pace do not meet: the first of them writes the checkpoint alone."""
    if dist.is_initialized() and topology.roles.lockstep:
        dist.barrier(group=topology.trainer_group)


def current_layout(cfg, dims) -> dict:
    return {
        "strategy": cfg.strategy.name,
        "dp": dims.dp,
        "cp": dims.cp,
        "tp": dims.tp,
        "pp": dims.pp,
        "ep": dims.ep,
    }


def describe(layout: dict) -> str:
    cp = f" parallel.cp={layout['cp']}" if layout.get("cp", 1) > 1 else ""
    ep = f" parallel.ep={layout['ep']}" if layout.get("ep", 1) > 1 else ""
    return (
        f"strategy={layout['strategy']} parallel.dp={layout['dp']}{cp} parallel.tp="
        f"{layout['tp']} parallel.pp={layout['pp']}{ep}"
    )


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
    # cp, ep: 1 in checkpoints written before plait had context or expert parallelism
    return not saved["engine_files"] or {k: saved.get(k, 1) for k in layout} != layout


def own_files_mismatch(engine, path: Path) -> str | None:
    """A setting of this run other than the layout with which the engine's own files in ``path``
    cannot be loaded, as ``key=value`` (an engine's optional ``own_files_mismatch``: ZeRO's
    ``sub_group_size``); None: they load. The same answer on every rank."""
    mismatch = getattr(engine, "own_files_mismatch", None)
    return mismatch(path) if mismatch else None


def checkpoint_to_load(cfg, topology) -> Path | None:
    """The checkpoint this rank loads (every trainer calls this: with node-local checkpoints,
    the nodes agree on it and fetch the parts they lack first)."""
    if cfg.checkpoint.local_dir is None:
        return resolve_resume(cfg, cfg.resume)
    own = None
    if cfg.resume in (AUTO, LATEST) or restarted():
        own = replication.restore(cfg, topology)
    if own is None and cfg.resume == LATEST:
        raise ValueError(
            f"resume=latest: no node holds a checkpoint of this run under "
            f"{node_root(cfg, 0).parent}; start with resume=auto"
        )
    if own is None and cfg.resume not in (None, AUTO):
        return resolve_resume(cfg, cfg.resume)  # another run's checkpoint
    return own


def load(cfg, engine, topology, reshardable: bool) -> TrainState | None:
    """Resume from the checkpoint ``cfg.resume`` names (None: nothing to resume): the engine's
    own files when this layout wrote them, else the layout-free copy (``reshardable``: the
    strategy takes it), then this rank's random state and the trainer state."""
    path = checkpoint_to_load(cfg, topology)
    if path is None:
        return None
    saved, layout = saved_layout(path), current_layout(cfg, topology.dims)
    converted = needs_conversion(saved, layout)
    if converted:
        if not reshardable:  # refused before launch; a checkpoint that changed since
            raise ValueError(
                f"resume: checkpoint {path} was written with {describe(saved)}; "
                f"strategy={cfg.strategy.name} cannot convert it: resume with "
                f"{describe(saved)}"
            )
        if topology.is_logging_rank:
            print(
                f"plait: converting checkpoint {path} from {describe(saved)} to "
                f"{describe(layout)} (layout-free DCP copy)",
                flush=True,
            )
        layout_free.load(engine, topology, path, topology.trainer_group)
    elif setting := own_files_mismatch(engine, path):
        if not (saved and saved["layout_free"] and reshardable):
            raise ValueError(
                f"resume: checkpoint {path}'s {cfg.strategy.name} files were written with "
                f"{setting} and hold no layout-free copy: resume with ++{setting}"
            )
        if topology.is_logging_rank:
            print(
                f"plait: checkpoint {path} was written with {setting}, which this run's "
                "engine cannot load: loading its layout-free DCP copy",
                flush=True,
            )
        layout_free.load(engine, topology, path, topology.trainer_group)
    else:
        engine.load_state(path)
    # the same ranks wrote it (a trainer at its own pace saves nothing but the first's)
    saved_mine = not converted and (topology.roles.lockstep or topology.is_logging_rank)
    load_rng(path, topology.rank, required=saved_mine)
    state = TrainState.from_dict(json.loads((path / TRAINER_STATE).read_text()))
    if not path.resolve().is_relative_to(checkpoint_root(cfg, topology.node_rank).resolve()):
        state = fork(state, path)
    if topology.is_logging_rank:
        print(f"plait: resumed from {path} at step {state.step}", flush=True)
    return state


def fork(state: TrainState, path: Path) -> TrainState:
    """Another run's checkpoint starts a new run: its weights, optimizer and data position are
    taken, its tracker run is not (the new run gets its own and names the other as parent)."""
    state.parent = {
        "run_name": state.run_name,
        "tracker_run_id": state.tracker_run_id,
        "step": state.step,
        "checkpoint": str(path),
    }
    state.tracker_run_id, state.run_name, state.metrics = None, None, {}
    return state


def save_if_due(cfg, engine, state, topology, final: bool, reshardable: bool) -> Path | None:
    """The checkpoint after ``state.step`` when one is due (every ``checkpoint.every``
    steps, and the final one); its directory, or None."""
    if not (topology.roles.lockstep or topology.is_logging_rank):
        return None  # at its own pace: the first trainer's engine saves the run's state
    if topology.quorum_rank != 0:  # replica groups as jobs: the step's first group writes
        if final:
            background.wait()
        return None
    every = cfg.checkpoint.every
    due = (final and cfg.checkpoint.save_final) or (every > 0 and state.step % every == 0)
    complete = save(cfg, engine, state, topology, reshardable) if due else None
    if final:
        background.wait()  # the run ends with its last checkpoint published
    return complete


def save(cfg, engine, state, topology, reshardable: bool) -> Path:
    """Every rank writes its part into ``.step_<n>.partial``; rank 0 publishes it when all
    parts are durable: now, or with ``checkpoint.async_save`` when the background write is done.
    With ``checkpoint.local_dir`` each node writes into its own root and publishes its own
    directory once every node's part and replicas are durable. ``reshardable``: the strategy
    declared ``engine:layout_free_state``, so a layout-free copy is written too."""
    background.wait()  # the previous write is published before its .partial could be removed
    node_local = cfg.checkpoint.local_dir is not None
    root = checkpoint_root(cfg, topology.node_rank)
    name = f"step_{state.step:08d}"
    partial, complete = root / f".{name}.partial", root / name
    in_background = cfg.checkpoint.async_save and reshardable
    # an engine whose own format cannot hold this layout (ZeRO with experts) writes only the
    # layout-free copy, from which a resume at any layout loads
    engine_files = not in_background and getattr(engine, "saves_engine_files", True)
    makes_directory = (topology.local_trainer_rank == 0) if node_local else topology.is_logging_rank
    if makes_directory:
        remove_leftovers(root)
        partial.mkdir(parents=True)
    barrier(topology)
    if engine_files:
        engine.save_state(partial)
    save_rng(partial, topology.rank)
    record = {
        **current_layout(cfg, topology.dims),
        "engine_files": engine_files,
        "layout_free": reshardable,
    }
    state.run_name = cfg.run.name  # a run resumed elsewhere (a PBT copy) names its source
    trainer_state = json.dumps(state.to_dict())

    def write_run_files() -> None:
        atomic_write_text(partial / LAYOUT, json.dumps(record))
        atomic_write_text(partial / TRAINER_STATE, trainer_state)

    def publish_on_rank0() -> None:
        if in_background:  # the writer fsynced its own files; the RNG states were not
            for file in partial.glob(RNG_FILE.format("*")):
                fsync_path(file)
        write_run_files()
        publish(root, partial, name)
        prune(root, cfg.checkpoint.keep_last)

    publisher = publish_on_rank0 if topology.is_logging_rank else None
    if in_background:
        background.start(
            lambda stager: layout_free.save(
                engine, topology, partial, topology.side_group("checkpoint writes"), stager
            ),
            publisher,
        )
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
        replication.replicate(partial, name, topology, cfg.checkpoint.replicas)
        barrier(topology)  # every node's part and replicas are durable: each node publishes
        if topology.local_trainer_rank == 0:
            publish(root, partial, name)
            prune(root, cfg.checkpoint.keep_last)
    elif publisher is not None:
        publisher()
    barrier(topology)
    return complete
