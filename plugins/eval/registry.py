"""Which tasks a run names, read from lm-evaluation-harness's task index before any model is
loaded: the harness's registry, plait's own tiny tasks (``tasks/`` beside this file) and the
user's ``include_path``. Reading the index parses YAML only; no dataset is opened.

The harness's own registry (~15,000 YAML files; 11-13 s to parse on a 2-core host, paid by the
launcher's checks and again by every rank) is indexed once per installed harness and kept in
plait's cache directory (``$PLAIT_CACHE_DIR``, else ``~/.cache/plait``, as for
``data.cache_dir``): later reads load it (about 1 s). The key is the
harness's version and location, as the harness's files do not change once installed; delete
``lm_eval-*.pickle`` there after editing them in place. plait's and the user's task directories
are indexed afresh every time.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import hashlib
import importlib.util
import os
import pickle
import tempfile
from pathlib import Path
from typing import Iterator

from plait.config import cache_dir

SHIPPED = Path(__file__).parent / "tasks"
GENERATION = "generate_until"


def harness_problems(setting: str) -> list[str]:
    """lm-evaluation-harness is an optional dependency (the ``eval`` extra)."""
    if importlib.util.find_spec("lm_eval") is None:
        return [
            f"{setting} needs lm-evaluation-harness, which is not installed: pip install "
            "'plait[eval]' (or pip install lm-eval)"
        ]
    return []


def offline() -> None:
    """Nothing is downloaded: the harness's datasets and hub calls read local files only.
    Set before ``datasets`` is imported (it reads them once); the config is set too when it
    was imported earlier."""
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"
    import datasets

    datasets.config.HF_DATASETS_OFFLINE = True
    datasets.config.HF_HUB_OFFLINE = True


def task_manager(include_path: str | None, tasks: tuple[str, ...] = ()):
    """The harness's ``TaskManager`` over plait's tasks, ``include_path`` and, unless every one
    of ``tasks`` is found there, the harness's registry (indexing its ~15,000 YAML files takes
    seconds)."""
    paths = (str(SHIPPED),) + ((str(Path(include_path).expanduser()),) if include_path else ())
    local = _manager(paths, include_defaults=False)
    if tasks and all(found_in(local, name) for name in tasks):
        return local
    return _manager(paths, include_defaults=True)


@functools.lru_cache(maxsize=8)
def _manager(paths: tuple[str, ...], include_defaults: bool):
    offline()
    from lm_eval.tasks import TaskManager

    with cached_harness_index():
        return TaskManager(include_path=list(paths), include_defaults=include_defaults)


def index_cache(root: Path) -> Path:
    """Where the index of the harness installed at ``root`` is kept."""
    from lm_eval import __version__

    where = hashlib.sha1(str(root.resolve()).encode()).hexdigest()[:8]
    return cache_dir() / f"lm_eval-{__version__}-{where}.pickle"


@contextlib.contextmanager
def cached_harness_index():
    """While a ``TaskManager`` is built: its index of the harness's own directory (the first of
    the paths it indexes, as the harness orders them) comes from the cache, made on first use;
    the other paths are indexed as the harness does, and override it as they would."""
    import lm_eval.tasks
    from lm_eval.tasks._index import TaskIndex

    root = Path(lm_eval.tasks.__file__).parent
    build = TaskIndex.build

    def build_with_cache(paths, **options):
        paths = [Path(p) for p in paths]
        if not paths or paths[0] != root or options:
            return build(paths, **options)
        index = read_or_make(index_cache(root), lambda: build([root]))
        index.update(build(paths[1:]))
        return index

    TaskIndex.build = staticmethod(build_with_cache)
    try:
        yield
    finally:
        TaskIndex.build = staticmethod(build)


def read_or_make(path: Path, make) -> dict:
    """The pickled index at ``path``; else ``make()``, written there whole (beside, then
    renamed: processes that read it meanwhile see the old file or none). A cache directory that
    cannot be written (a read-only home) costs the cache, not the run."""
    try:
        with open(path, "rb") as f:
            return pickle.load(f)
    except Exception:  # noqa: BLE001 - missing, unreadable, from another harness: make it again
        pass
    index = make()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, delete=False) as f:
            pickle.dump(index, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(f.name, path)
    except OSError:
        pass
    return index


def found_in(manager, name: str) -> bool:
    """``name`` and, for a group, every task it names by name, are in ``manager``'s index."""
    entry = manager.task_index.get(name)
    if entry is None or entry.kind.name != "GROUP":
        return entry is not None
    return all(
        isinstance(task, dict) or found_in(manager, task)
        for task in (entry.cfg or {}).get("task", [])
    )


def leaf_configs(manager, name: str, seen: frozenset[str] = frozenset()) -> Iterator[dict]:
    """The configs of the tasks ``name`` stands for (itself, a group's tasks, a tag's)."""
    from lm_eval.tasks._index import Kind

    entry = manager.task_index[name]
    if entry.kind in (Kind.TASK, Kind.PY_TASK):
        yield entry.cfg or {}
    elif entry.kind == Kind.TAG:
        for other in manager.task_index.values():
            if name in other.tags and other.name not in seen:
                yield from leaf_configs(manager, other.name, seen | {name})
    elif entry.kind == Kind.GROUP:
        for task in (entry.cfg or {}).get("task", []):
            if isinstance(task, dict):
                yield task
            elif task in manager.task_index and task not in seen:
                yield from leaf_configs(manager, task, seen | {name})


def task_problems(
    manager, tasks: list[str], setting: str, has_tokenizer: bool, tokenizer_hint: str
) -> list[str]:
    """An unknown task named with the closest known names; with no tokenizer, every task (its
    text cannot be encoded), a generation task saying that nothing could decode its output."""
    problems = []
    for name in tasks:
        if name not in manager.task_index:
            close = difflib.get_close_matches(name, manager.all_tasks, n=5, cutoff=0.6)
            problems.append(
                f"{setting}: unknown task {name!r}"
                + (f"; closest: {', '.join(close)}" if close else "")
                + " (tasks come from lm-evaluation-harness's registry, plait's "
                "plait_tiny_mc and plait_tiny_gen, and eval.include_path=<dir of "
                "task YAML files>)"
            )
            continue
        if has_tokenizer:
            continue
        if any(cfg.get("output_type") == GENERATION for cfg in leaf_configs(manager, name)):
            problems.append(
                f"{setting}: {name!r} is a generation task (output_type: "
                f"{GENERATION}), but there is no tokenizer to decode what the model "
                f"generates: {tokenizer_hint}"
            )
        else:
            problems.append(
                f"{setting}: {name!r} needs its text encoded, but there is no "
                f"tokenizer: {tokenizer_hint}"
            )
    return problems
