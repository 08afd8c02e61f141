"""The checkpoint directory: where checkpoints live, which of them are complete, and how one
is published atomically.

Layout under ``run.dir/checkpoints`` (or, with ``checkpoint.local_dir``, under each node's own
``<checkpoint.local_dir>/<run.name>/node<k>``)::

    step_00000040/            one directory per checkpoint: engine files, trainer_state.json,
                              layout.json, rng_rank<r>.pt, and complete.json (written last)
    latest                    the name of the newest complete checkpoint (for people and tools)

A checkpoint is written into ``.step_<n>.partial``; :func:`publish` writes ``complete.json``
(every file's size), renames the directory into place and then replaces ``latest`` by rename.
Only a directory whose ``complete.json`` matches its files counts as a checkpoint
(:func:`checkpoint_problem`); stale ``.partial`` directories are removed by the next save.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

from plait.engine.files import atomic_write_text, fsync_path

LATEST = "latest"
AUTO = "auto"
TRAINER_STATE = "trainer_state.json"
COMPLETE = "complete.json"
LAYOUT = "layout.json"


def node_root(cfg, node: int) -> Path:
    """Where node ``node`` keeps its checkpoints (on its own disk) with ``checkpoint.local_dir``."""
    return Path(cfg.checkpoint.local_dir) / cfg.run.name / f"node{node}"


def checkpoint_root(cfg, node: int | None = None) -> Path:
    """Where checkpoints are written: the run directory's, or node ``node``'s own."""
    if cfg.checkpoint.local_dir is None:
        return Path(cfg.run.dir) / "checkpoints"
    return node_root(cfg, node)


def visible_roots(cfg) -> list[Path]:
    """The checkpoint roots this machine sees before launch (node-local: every node root on
    it, for the checks that need no processes)."""
    if cfg.checkpoint.local_dir is None:
        return [checkpoint_root(cfg)]
    return sorted(node_root(cfg, 0).parent.glob("node*"))


def newest_visible(cfg) -> Path | None:
    """The newest complete checkpoint on this machine; node-local: one that holds the run's own
    files (node 0's part: ``layout.json``, ``trainer_state.json``)."""
    if cfg.checkpoint.local_dir is None:
        return latest_checkpoint(checkpoint_root(cfg), quiet=True)
    found = [
        c
        for root in visible_roots(cfg)
        if (c := latest_checkpoint(root, quiet=True)) and (c / TRAINER_STATE).exists()
    ]
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
    return any(
        int(os.environ.get(v, 0)) > 0 for v in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")
    )


def resolve_resume(cfg, resume: str | None) -> Path | None:
    """The checkpoint directory to resume from, or None for a fresh start.

    ``auto``: this run directory's newest complete checkpoint, else a fresh start. ``latest``:
    the same, but there must be one. A path names a checkpoint directory or a run directory (its
    newest complete checkpoint). A restarted process (torch elastic, a SLURM requeue) always
    continues from this run's own newest checkpoint when there is one.
    """
    own = (
        newest_visible(cfg) if cfg.checkpoint.local_dir else latest_checkpoint(checkpoint_root(cfg))
    )
    if resume in (AUTO, LATEST) or (restarted() and own is not None):
        return own
    if resume is None:
        return None
    path = Path(resume).expanduser()
    if (path / COMPLETE).exists() or (path / TRAINER_STATE).exists():
        problem = checkpoint_problem(path)
        if problem is not None:
            raise ValueError(
                f"resume={resume}: not a complete checkpoint: {problem}; give "
                "another checkpoint, or the run directory for its newest "
                "complete one"
            )
        return path
    for root in (path / "checkpoints", path):
        found = latest_checkpoint(root)
        if found is not None:
            return found
    return None


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
    files = {
        str(f.relative_to(partial)): f.stat().st_size
        for f in sorted(partial.rglob("*"))
        if f.is_file()
    }
    atomic_write_text(partial / COMPLETE, json.dumps({"files": files}))
    complete = root / name
    if complete.exists():
        others = [
            p
            for p in sorted(root.glob("step_*"))
            if p != complete and checkpoint_problem(p) is None
        ]
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
