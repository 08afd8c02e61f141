"""Exact cuts in a large plain-text document, so that one big file is tokenized by many tasks
in parallel and still gives exactly the tokens of tokenizing it whole.

A cut is made after a line end followed by a non-space character, near every ``piece_bytes``
of the file, and only where the tokenizer gives the same ids for the text around the cut as for
its two sides apart: ``encode(left + right) == encode(left) + encode(right)`` over ``WINDOW``
bytes each side, through the tokenizer's whole pipeline (added tokens, normaliser,
pre-tokenizer, model; special tokens off, the post-processor's are added per document). Byte
tokens cut anywhere. For byte-level BPE with a GPT-2 or Llama-3 style split pattern such a cut
is where the pre-tokenizer splits anyway, and BPE never merges across pre-tokens, so the check
holds for the whole document, not only the window. A tokenizer whose pipeline reaches across
the text (no pre-tokenizer; a normaliser that prepends to the whole text, or strips it) fails
the check and its documents are never cut: one task reads each whole.
"""

from __future__ import annotations

from typing import Callable

WINDOW = 512  # bytes each side of a cut checked with the tokenizer
SPACE = frozenset(b" \t\n\r\x0b\x0c")


def text_cuts(
    read: Callable[[int, int], bytes], size: int, piece_bytes: int, tokenizer
) -> list[int]:
    """Byte offsets inside a document of ``size`` bytes (``read(offset, n)`` gives its bytes)
    where it is cut into pieces of about ``piece_bytes``; none when the tokenizer cannot cut."""
    if size < 2 * piece_bytes or not tokenizer.can_cut:
        return []
    cuts, target = [], piece_bytes
    while target < size:
        end = min(target + piece_bytes, size)
        cut = exact_cut(read, size, target, end, tokenizer)
        if cut is not None:
            cuts.append(cut)
        target = (cut if cut is not None else target) + piece_bytes
    return cuts


def exact_cut(
    read: Callable[[int, int], bytes], size: int, start: int, end: int, tokenizer
) -> int | None:
    """The first offset in ``[start, end)`` after a line end, before a non-space, that the
    tokenizer cuts exactly."""
    base = max(start - WINDOW, 0)
    block = read(base, min(end + WINDOW, size) - base)
    i = start - base - 1
    while (i := block.find(b"\n", max(i, 0))) >= 0 and base + i + 1 < end:
        c = i + 1
        if block[c] not in SPACE and tokenizer.cut_is_exact(
            block[max(c - WINDOW, 0) : c], block[c : c + WINDOW]
        ):
            return base + c
        i += 1
    return None
