"""The formats corpora ship in, as documents: what ``plait prepare`` (and ``data=text``) read.

| format | recognised by | a document is | cut into pieces at |
| --- | --- | --- | --- |
| JSON lines | ``.jsonl``, ``.ndjson``, ``.json`` | a line's ``data.text_field`` | lines |
| parquet | ``.parquet`` | a row's ``data.text_field`` column | row groups |
| ``datasets`` | a ``save_to_disk`` directory, or a name in the HF cache | a row's field | rows |
| plain text | any other file | the whole file | (by :mod:`cutting`) |

Any of them but parquet may be compressed: ``.gz``, ``.zst``, ``.bz2``, ``.xz`` after the
format's suffix (``dolma.json.gz``, ``rp.jsonl.zst``, ``book.txt.xz``), read as a stream.

A *piece* is a range of one source in that source's own unit: bytes of the (decompressed) file
for text and JSON lines, row groups for parquet, rows for ``datasets``. :func:`scan` reads each
source once before any work starts, refusing bad input by name (a parquet file without the
column, a file that does not decompress, a JSON line without the field, a missing split), and
says where it may be cut; :func:`read_documents` reads the documents of one piece, streaming.

Taken from the libraries: pyarrow reads parquet a batch of rows at a time (``iter_batches`` over
the piece's row groups), HF ``datasets`` opens its directories and cache (memory-mapped Arrow),
fsspec opens every path or URL, the standard library and ``zstandard`` decompress. Written here:
which format a file is, the pieces, the checks and their messages.
"""

from __future__ import annotations

import bz2
import gzip
import io
import json
import lzma
import os
from dataclasses import dataclass
from typing import Iterator, Optional, Union

COMPRESSIONS = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd", ".bz2": "bz2", ".xz": "xz"}
JSON_LINES = (".jsonl", ".ndjson", ".json")
PARQUET = (".parquet",)
TEXT, JSONL, PARQUET_FORMAT, DATASETS = "text", "jsonl", "parquet", "datasets"
PROBE_BYTES = 1 << 16  # the head of a plain file checked for NUL bytes (binary, not text)
ROWS_PER_BATCH = 1024  # parquet / datasets rows read at once
READ_CHUNK = 1 << 20
KNOWN = (
    "plain text, JSON lines (.jsonl, .ndjson, .json), parquet, compressed with .gz, .zst, "
    ".bz2 or .xz, and datasets directories (save_to_disk)"
)

Text = Union[str, bytes]


@dataclass(frozen=True)
class Source:
    """One input: a file (local path or fsspec URL), a ``datasets`` directory, or the name of a
    dataset in the local Hugging Face cache."""

    path: str
    format: str  # text | jsonl | parquet | datasets
    compression: Optional[str]  # gzip | zstd | bz2 | xz
    key: str  # changes when the input changes (size and mtime, or the object's ETag)
    size: int  # bytes on storage

    @property
    def cuttable(self) -> bool:
        """Whether a piece can start anywhere but at 0 without reading what comes before."""
        return self.compression is None


@dataclass(frozen=True)
class Piece:
    source: int  # index into the plan's sources
    start: int
    end: int
    text_bytes: int  # about how much text it holds, for balancing tasks


class InputError(ValueError):
    """Input that cannot be read as it says it is; the message names the file and the fix."""


def file_format(name: str) -> tuple[str, Optional[str]]:
    """``(format, compression)`` of a file name by its suffixes."""
    lower = name.lower()
    compression = next((c for s, c in COMPRESSIONS.items() if lower.endswith(s)), None)
    if compression:
        lower = lower[: lower.rfind(".")]
    if lower.endswith(JSON_LINES):
        return JSONL, compression
    if lower.endswith(PARQUET) and compression is None:
        return PARQUET_FORMAT, None
    return TEXT, compression


# ---------------------------------------------------------------------------------------------
# opening files
# ---------------------------------------------------------------------------------------------


class ZstdFrames(io.RawIOBase):
    """A zstd stream of one or more frames; unlike ``zstandard``'s ``stream_reader``, a stream
    that ends inside a frame raises instead of ending early."""

    def __init__(self, raw):
        import zstandard

        self.raw, self.zstd = raw, zstandard
        self.frame = zstandard.ZstdDecompressor().decompressobj()
        self.pending, self.in_frame = b"", False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self.pending:
            data = self.raw.read(READ_CHUNK)
            if not data:
                if self.in_frame:
                    raise EOFError("the zstd stream ends inside a frame (truncated)")
                return 0
            while data:
                self.in_frame = True
                self.pending += self.frame.decompress(data)
                data = b""
                if self.frame.eof:  # a frame ended: the rest starts the next one
                    data, self.in_frame = self.frame.unused_data, False
                    self.frame = self.zstd.ZstdDecompressor().decompressobj()
        n = min(len(buffer), len(self.pending))
        buffer[:n], self.pending = self.pending[:n], self.pending[n:]
        return n


def open_file(path: str):
    """A binary file object of ``path`` (a local path or fsspec URL), decompressed."""
    from fsspec.core import url_to_fs

    fs, inner = url_to_fs(path)
    raw = fs.open(inner, "rb")
    compression = file_format(path)[1]
    if compression == "gzip":
        return gzip.GzipFile(fileobj=raw)
    if compression == "bz2":
        return bz2.BZ2File(raw)
    if compression == "xz":
        return lzma.LZMAFile(raw)
    if compression == "zstd":
        return io.BufferedReader(ZstdFrames(raw), READ_CHUNK)
    return raw


def skip(f, n: int, relative: bool = False) -> None:
    """Move a stream from its start (or, ``relative``, from where it is) ``n`` bytes on: a seek
    where it can, else read and drop (compressed)."""
    if f.seekable() and not isinstance(f, (gzip.GzipFile, bz2.BZ2File, lzma.LZMAFile)):
        f.seek(n, os.SEEK_CUR if relative else os.SEEK_SET)
        return
    while n > 0:
        n -= len(f.read(min(n, READ_CHUNK)))


DECOMPRESS_ERRORS = (OSError, EOFError, lzma.LZMAError, ValueError)


def not_decompressed(path: str, error: Exception) -> InputError:
    return InputError(
        f"{path} does not decompress as {file_format(path)[1]} "
        f"({type(error).__name__}: {error}): replace the file, or remove it from "
        "data.path"
    )


# ---------------------------------------------------------------------------------------------
# the scan: checks, and where a source may be cut
# ---------------------------------------------------------------------------------------------


def scan(
    source: Source, text_field: str, piece_bytes: int, split: str, subset: Optional[str]
) -> list[Piece]:
    """The pieces of ``source`` (index 0 here; the plan renumbers), or :class:`InputError`."""
    if source.format == PARQUET_FORMAT:
        return scan_parquet(source, text_field)
    if source.format == DATASETS:
        return scan_datasets(source, text_field, piece_bytes, split, subset)
    try:
        if source.format == JSONL:
            return scan_json_lines(source, text_field, piece_bytes)
        return scan_text(source)
    except InputError:
        raise
    except Exception as e:
        if source.compression and isinstance(e, DECOMPRESS_ERRORS) or _is_zstd_error(e):
            raise not_decompressed(source.path, e) from None
        raise


def _is_zstd_error(e: Exception) -> bool:
    return type(e).__module__.startswith("zstandard")


def scan_text(source: Source) -> list[Piece]:
    """A plain file is one document; a compressed one is read through (it must decompress)."""
    with open_file(source.path) as f:
        head = f.read(PROBE_BYTES)
        if b"\0" in head:
            raise InputError(
                f"{source.path} is not text (it holds NUL bytes): plait prepare "
                f"reads {KNOWN}; remove it from data.path"
            )
        size = len(head)
        if source.compression:
            while chunk := f.read(READ_CHUNK):
                size += len(chunk)
        else:
            size = source.size
    return [Piece(0, 0, size, size)] if size else []


def scan_json_lines(source: Source, text_field: str, piece_bytes: int) -> list[Piece]:
    """Every line parsed (a JSON object holding ``text_field`` as a string, or blank); a piece
    ends at the first line end past each ``piece_bytes``."""
    pieces, start, position = [], 0, 0
    with open_file(source.path) as f:
        for number, line in enumerate(f, 1):
            position += len(line)
            if line.strip():
                json_line_text(line, text_field, f"{source.path} line {number}")
            if position - start >= piece_bytes:
                pieces.append(Piece(0, start, position, position - start))
                start = position
    if position > start:
        pieces.append(Piece(0, start, position, position - start))
    return pieces


def json_line_text(line: bytes, text_field: str, where: str) -> Optional[str]:
    """The text of one JSON line; ``where`` names the line in a refusal."""
    try:
        record = json.loads(line)
    except ValueError as e:
        raise InputError(
            f"{where} is not JSON ({e}): plait prepare reads "
            "JSON lines (one object per line) from .jsonl, .ndjson and .json "
            "files; fix the line, or rename a file that is not JSON lines"
        ) from None
    if not isinstance(record, dict) or text_field not in record:
        fields = ", ".join(record) if isinstance(record, dict) else type(record).__name__
        raise InputError(
            f"{where} has no field {text_field!r} (it has: {fields}): "
            "set data.text_field=<the field holding the text>"
        )
    text = record[text_field]
    if text is not None and not isinstance(text, str):
        raise InputError(
            f"{where}: field {text_field!r} holds "
            f"{type(text).__name__}, not text: set data.text_field=<the field "
            "holding the text>"
        )
    return text


def parquet_file(path: str):
    import pyarrow.parquet as pq
    from fsspec.core import url_to_fs

    fs, inner = url_to_fs(path)
    return pq.ParquetFile(fs.open(inner, "rb"))


def scan_parquet(source: Source, text_field: str) -> list[Piece]:
    """The schema (the column, a string type) and the row groups' sizes, from the footer."""
    import pyarrow as pa

    try:
        meta = parquet_file(source.path).metadata
    except Exception as e:
        raise InputError(
            f"{source.path} is not a parquet file ({type(e).__name__}: {e}): "
            "replace it, or remove it from data.path"
        ) from None
    schema = meta.schema.to_arrow_schema()
    if text_field not in schema.names:
        raise InputError(
            f"{source.path} has no column {text_field!r} (its columns: "
            f"{', '.join(schema.names)}): set data.text_field=<the text column>"
        )
    kind = schema.field(text_field).type
    if not (
        pa.types.is_string(kind) or pa.types.is_large_string(kind) or str(kind) == "string_view"
    ):
        raise InputError(
            f"{source.path}: column {text_field!r} holds {kind}, not text: set "
            "data.text_field=<the text column>"
        )
    column = schema.get_field_index(text_field)
    return [
        Piece(0, g, g + 1, meta.row_group(g).column(column).total_uncompressed_size)
        for g in range(meta.num_row_groups)
    ]


def scan_datasets(
    source: Source, text_field: str, piece_bytes: int, split: str, subset: Optional[str]
) -> list[Piece]:
    from plait.plugins.data.hf_datasets import open_dataset

    dataset = open_dataset(source.path, split, subset)
    if text_field not in dataset.column_names:
        raise InputError(
            f"{source.path} (split {split}) has no column {text_field!r} (its "
            f"columns: {', '.join(dataset.column_names)}): set "
            "data.text_field=<the text column>"
        )
    rows = dataset.num_rows
    if rows == 0:
        return []
    nbytes = dataset.data.column(text_field).nbytes
    step = max(1, int(rows * piece_bytes / max(nbytes, 1)))
    return [
        Piece(0, a, min(a + step, rows), nbytes * (min(a + step, rows) - a) // rows)
        for a in range(0, rows, step)
    ]


# ---------------------------------------------------------------------------------------------
# reading a piece
# ---------------------------------------------------------------------------------------------


def read_documents(
    source: Source, start: int, end: int, text_field: str, split: str, subset: Optional[str]
) -> Iterator[tuple[Text, bool, bool]]:
    """``(text, first, last)`` of each document in ``[start, end)``: whether this piece holds
    the document's start and its end (only a plain text file is cut inside a document).
    Empty documents are skipped."""
    if source.format == TEXT:
        yield from read_text(source, start, end)
    elif source.format == JSONL:
        for text in read_json_lines(source, start, end, text_field):
            yield text, True, True
    elif source.format == PARQUET_FORMAT:
        for text in read_parquet(source, start, end, text_field):
            yield text, True, True
    else:
        from plait.plugins.data.hf_datasets import read_rows

        for text in read_rows(source.path, split, subset, start, end, text_field):
            yield text, True, True


def read_text(source: Source, start: int, end: int) -> Iterator[tuple[bytes, bool, bool]]:
    with open_file(source.path) as f:
        skip(f, start)
        data = f.read(end - start)
        last = not f.read(1) if source.compression else end >= source.size
    if data:
        yield data, start == 0, last


def read_json_lines(source: Source, start: int, end: int, text_field: str) -> Iterator[str]:
    f = stream_at(source, start)
    position = start
    try:
        while position < end:
            line = f.readline()
            if not line:
                break
            if line.strip():
                text = json_line_text(
                    line, text_field, f"{source.path} (the line at byte {position})"
                )
                if text:
                    yield text
            position += len(line)
    except BaseException:  # an error, or the reader stopped early (GeneratorExit)
        f.close()
        raise
    if source.compression:
        _kept[source.path] = (f, position)
    else:
        f.close()


# A compressed stream left open where its last piece ended: a worker takes its tasks in order,
# so the next piece it reads of that file usually lies further on, and only the bytes between
# are decompressed again (a task of a compressed file that no worker left open decompresses
# from the file's start: there is no index to seek by).
_kept: dict[str, tuple] = {}


def stream_at(source: Source, start: int):
    """A binary stream of ``source``, decompressed, at byte ``start``."""
    for path, (f, position) in list(_kept.items()):
        if path == source.path and position <= start:
            del _kept[path]
            skip(f, start - position, relative=True)
            return f
        del _kept[path]
        f.close()
    f = open_file(source.path)
    skip(f, start)
    return f


def close_streams() -> None:
    """Close the stream :func:`read_json_lines` kept open (a prepare's end, a forked worker)."""
    for f, _ in _kept.values():
        f.close()
    _kept.clear()


def read_parquet(source: Source, start: int, end: int, text_field: str) -> Iterator[str]:
    pf = parquet_file(source.path)
    for batch in pf.iter_batches(
        batch_size=ROWS_PER_BATCH, row_groups=range(start, end), columns=[text_field]
    ):
        for text in batch.column(0).to_pylist():
            if text:
                yield text
