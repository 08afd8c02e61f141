"""Pre-tokenized ``.bin`` files, in the two layouts people bring:

- nanoGPT (``data/*/prepare.py``): the token ids as uint16, nothing else;
- llm.c (``dev/data/data_common.py: write_datafile``): a header of 256 little-endian int32 —
  magic, version, token count, zeros — then the ids, uint16 (magic 20240520, version 1, GPT-2)
  or uint32 (magic 20240801, version 7, Llama 3).

:func:`token_layout` tells them apart by the magic number and checks the file's size against
what its layout promises, so a file that is neither is refused before any worker reads it.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass
from pathlib import Path

import numpy as np

LLMC_FORMATS = {20240520: (1, np.uint16), 20240801: (7, np.uint32)}  # magic: (version, dtype)
LLMC_HEADER_BYTES = 256 * 4
TEXT_PROBE_BYTES = 1 << 16


@dataclass(frozen=True)
class TokenLayout:
    dtype: type
    offset: int  # bytes before the first token
    n_tokens: int


def token_layout(path: Path) -> TokenLayout:
    """Where ``path`` keeps its tokens; ``ValueError`` naming the file when its size does not fit
    either layout."""
    size = path.stat().st_size
    head = np.fromfile(path, dtype="<i4", count=3).tolist() if size >= 12 else []
    if head and head[0] in LLMC_FORMATS:
        magic, version, n_tokens = head
        want_version, dtype = LLMC_FORMATS[magic]
        expected = LLMC_HEADER_BYTES + n_tokens * np.dtype(dtype).itemsize
        if version != want_version or size != expected:
            raise ValueError(
                f"{path} starts with llm.c's magic {magic} but does not fit its layout (version "
                f"{version}, expected {want_version}; {n_tokens} tokens need {expected} bytes, "
                f"the file has {size}): it is truncated or not an llm.c token file"
            )
        if n_tokens == 0:
            raise ValueError(f"{path} is an llm.c token file without tokens")
        return TokenLayout(dtype, LLMC_HEADER_BYTES, n_tokens)
    if size == 0 or size % 2:
        raise ValueError(
            f"{path} has {size} bytes, not a whole number of uint16 tokens: give a nanoGPT token "
            "file (uint16 ids, no header) or an llm.c one (256-int32 header, then the ids)"
        )
    return TokenLayout(np.uint16, 0, size // 2)


def read_tokens(path: Path) -> np.memmap:
    layout = token_layout(path)
    return np.memmap(
        path, dtype=layout.dtype, mode="r", offset=layout.offset, shape=(layout.n_tokens,)
    )


def looks_like_text(path: Path) -> bool:
    """True when the file opens as UTF-8 text without a NUL byte. A uint16 token file has a NUL
    high byte in every id below 256 (newlines, spaces, punctuation in any BPE vocabulary), and
    its low bytes are rarely valid UTF-8: real token files fail this test within a few KiB."""
    with open(path, "rb") as f:
        probe = f.read(TEXT_PROBE_BYTES)
    if not probe or b"\0" in probe:
        return False
    try:
        codecs.getincrementaldecoder("utf-8")().decode(probe, final=False)
    except UnicodeDecodeError:
        return False
    return True
