"""Loads the shipped tasks' data files (``dataset_kwargs.data_files``) from this directory
with the ``datasets`` JSON builder, which resolves relative paths against the working
directory instead; lm-evaluation-harness calls it as the tasks' ``custom_dataset``."""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).parent


def load(data_files: dict[str, str], **_metadata):
    import datasets

    return datasets.load_dataset(
        "json", data_files={split: str(HERE / name) for split, name in data_files.items()}
    )
