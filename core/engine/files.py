"""Files a crash cannot leave half-written: written beside, flushed to disk, renamed into place
(the rename is atomic on POSIX), and the directory flushed so the rename itself survives. What
checkpoints (plait's, and the Hugging Face copies written during training) are published with."""

from __future__ import annotations

import os
from pathlib import Path


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
