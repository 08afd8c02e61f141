"""Hugging Face ``datasets`` as a source of documents: a directory written by ``save_to_disk``
(a ``Dataset`` or a ``DatasetDict`` of splits), or the name of a dataset already in the local
Hugging Face cache (``HF_DATASETS_CACHE``), opened with the hub switched off: nothing is
downloaded. Both are memory-mapped Arrow tables, read a batch of rows at a time.

``datasets`` does the opening (``load_from_disk``, ``load_dataset`` of a cached name); written
here: which split, the refusals, and reading a range of rows.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path
from typing import Iterator, Optional

from plait.plugins.data.formats import ROWS_PER_BATCH, InputError

DATASET_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")  # "name" or "org/name"


def is_datasets_directory(path: Path) -> bool:
    """A directory ``save_to_disk`` wrote: a ``DatasetDict`` or a single ``Dataset``."""
    return path.is_dir() and (
        (path / "dataset_dict.json").is_file()
        or ((path / "state.json").is_file() and (path / "dataset_info.json").is_file())
    )


def looks_like_dataset_name(entry: str) -> bool:
    return "://" not in entry and bool(DATASET_NAME.match(entry))


def offline() -> None:
    """Keep ``datasets`` and the hub client off the network, also when they were imported
    before (their flags are read at import)."""
    os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"
    import datasets.config
    import huggingface_hub.constants

    datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = True
    huggingface_hub.constants.HF_HUB_OFFLINE = True


@functools.lru_cache(maxsize=8)
def open_dataset(path: str, split: str, subset: Optional[str]):
    """The ``datasets.Dataset`` of ``split`` in a ``save_to_disk`` directory or a cached
    dataset; :class:`InputError` naming it and the fix."""
    offline()
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    if Path(path).is_dir():
        loaded = datasets.load_from_disk(path)
        if isinstance(loaded, datasets.Dataset):
            return loaded
        if split not in loaded:
            raise InputError(
                f"{path} has no split {split!r} (its splits: "
                f"{', '.join(loaded)}): set data.split=<one of them>"
            )
        return loaded[split]
    try:
        return datasets.load_dataset(path, subset, split=split)
    except ValueError as e:
        if "Unknown split" in str(e):
            raise InputError(
                f"dataset {path} in the Hugging Face cache has no split "
                f"{split!r} ({e}): set data.split=<one of them>"
            ) from None
        raise InputError(
            f"dataset {path} cannot be read from the Hugging Face cache "
            f"({e}): check data.subset and data.split"
        ) from None
    except (ConnectionError, FileNotFoundError, OSError):
        cache = datasets.config.HF_DATASETS_CACHE
        raise InputError(
            f"data.path entry {path} matches no file, and no dataset of that name "
            f"is in the local Hugging Face cache ({cache}): nothing is downloaded; "
            "give files, directories, globs, URLs or a save_to_disk directory, or "
            "load the dataset once where the hub is reachable"
        ) from None


def read_rows(
    path: str, split: str, subset: Optional[str], start: int, end: int, text_field: str
) -> Iterator[str]:
    """The non-empty texts of rows ``[start, end)``."""
    rows = open_dataset(path, split, subset).select_columns([text_field])
    for batch in rows.select(range(start, end)).iter(batch_size=ROWS_PER_BATCH):
        for text in batch[text_field]:
            if text:
                yield text


def dataset_key(path: str, split: str, subset: Optional[str]) -> tuple[str, int]:
    """What changes when the dataset changes, and its size: its Arrow files' paths, sizes and
    modification times."""
    files = [f["filename"] for f in open_dataset(path, split, subset).cache_files]
    stats = [(f, os.stat(f)) for f in sorted(files)]
    return (
        ";".join(f"{f}:{s.st_size}:{s.st_mtime_ns}" for f, s in stats),
        sum(s.st_size for _, s in stats),
    )
