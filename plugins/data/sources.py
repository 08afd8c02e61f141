"""What ``data.path`` names: a file, a directory (searched recursively, hidden entries skipped), a
glob, or a list of them, locally or at any fsspec URL (``s3://``, ``gs://``, ``hf://``); a
``datasets`` directory written by ``save_to_disk``; or the name of a dataset in the local Hugging
Face cache (``org/name``, when no such file exists). The order is the entries' order, each
entry's files sorted, each source once: the documents' order in the shards.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path
from typing import Optional

from plait.plugins.data.formats import DATASETS, InputError, Source, file_format
from plait.plugins.data.hf_datasets import (
    dataset_key,
    is_datasets_directory,
    looks_like_dataset_name,
    open_dataset,
)


def find_sources(entries: list, split: str, subset: Optional[str]) -> list[Source]:
    found: dict[str, Source] = {}
    for entry in entries:
        entry = str(entry)
        sources = (
            url_sources(entry)
            if "://" in entry
            else local_sources(os.path.expanduser(entry), split, subset)
        )
        if not sources:
            raise InputError(
                f"data.path entry {entry} matches no file: give files, "
                "directories, globs, URLs, a datasets directory or the name of a "
                "dataset in the local Hugging Face cache"
            )
        for source in sources:
            found.setdefault(source.path, source)
    return list(found.values())


def file_source(path: str, size: int, key: str) -> Source:
    return Source(path, *file_format(path), key=key, size=size)


def local_sources(entry: str, split: str, subset: Optional[str]) -> list[Source]:
    if glob.has_magic(entry):
        matches = [Path(p) for p in sorted(glob.glob(entry, recursive=True))]
    elif not os.path.exists(entry) and looks_like_dataset_name(entry):
        return [datasets_source(entry, split, subset)]
    else:
        matches = [Path(entry)]
    sources = []
    for path in matches:
        if is_datasets_directory(path):
            sources.append(datasets_source(str(path.resolve()), split, subset))
        elif path.is_dir():
            sources += directory_sources(path, split, subset)
        elif path.is_file():
            sources.append(local_file(path))
    return sources


def local_file(path: Path) -> Source:
    st = path.stat()
    return file_source(str(path.resolve()), st.st_size, f"{st.st_size}:{st.st_mtime_ns}")


def directory_sources(root: Path, split: str, subset: Optional[str]) -> list[Source]:
    """Files under ``root`` in path order; a ``datasets`` directory inside is one source."""
    sources = []
    for directory, subdirectories, files in os.walk(root):
        subdirectories[:] = sorted(d for d in subdirectories if not d.startswith("."))
        here = Path(directory)
        if here != root and is_datasets_directory(here):
            subdirectories[:] = []
            sources.append((here, datasets_source(str(here.resolve()), split, subset)))
            continue
        sources += [(here / f, local_file(here / f)) for f in files if not f.startswith(".")]
    return [source for _, source in sorted(sources, key=lambda s: s[0])]


def datasets_source(path: str, split: str, subset: Optional[str]) -> Source:
    open_dataset(path, split, subset)  # refuses a missing split or an uncached name
    key, size = dataset_key(path, split, subset)
    return Source(path, DATASETS, None, key=f"{split}:{subset}:{key}", size=size)


def url_sources(entry: str) -> list[Source]:
    from fsspec.core import url_to_fs

    try:
        fs, path = url_to_fs(entry)
        if glob.has_magic(path):
            infos = [fs.info(p) for p in sorted(fs.glob(path))]
        elif fs.isdir(path):
            infos = [
                i
                for p, i in sorted(fs.find(path, detail=True).items())
                if not any(part.startswith(".") for part in p[len(path) :].split("/"))
            ]
        else:
            infos = [fs.info(path)] if fs.exists(path) else []
    except (ImportError, ValueError, OSError) as e:
        raise InputError(
            f"data.path entry {entry} cannot be reached ({type(e).__name__}: {e}): "
            "check the URL, or install the fsspec backend for its protocol "
            "(s3fs for s3://, gcsfs for gs://)"
        ) from None
    return [
        file_source(fs.unstrip_protocol(i["name"]), int(i.get("size") or 0), info_key(i))
        for i in infos
        if i.get("type", "file") == "file"
    ]


def info_key(info: dict) -> str:
    """What changes when a remote object changes: its ETag (S3, GCS) or modification time."""
    for name in ("ETag", "etag", "md5Hash", "mtime", "LastModified", "last_modified"):
        if info.get(name) is not None:
            return f"{info.get('size')}:{info[name]}"
    return str(info.get("size"))
