"""The tensors of a Hugging Face checkpoint directory, ``model.safetensors`` or shards named by
``model.safetensors.index.json``: checked from the headers alone before launch, read box by box
in the workers.

A safetensors file is an 8-byte little-endian header length ``n``, ``n`` bytes of JSON
(``{name: {"dtype", "shape", "data_offsets": [start, end]}}``, offsets into the data after the
header), then the data. So a file is whole exactly when its size is ``8 + n + max(end)``, and an
index is consistent when every file it names exists, holds the names it maps there, and the
tensors' bytes add up to its ``metadata.total_size``: all of that is checked without reading a
tensor. A worker reads the box ``full[box]`` of one tensor through safetensors'
``safe_open(...).get_slice``, which maps the file and copies only the pages of that box; the
file is closed after each tensor, so at most one tensor's pages are ever mapped.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# safetensors dtype names plait trains from (into fp32 master weights, which hold them exactly);
# anything else (int8, fp8, packed 4-bit, and fp64, which fp32 would round) the run cannot hold.
FLOAT_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


@dataclass(frozen=True)
class TensorEntry:
    """One tensor as its file's header describes it."""

    file: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


def read_header(path: Path) -> tuple[dict, int]:
    """The header of a safetensors file (without ``__metadata__``) and the size the file must
    have. ``ValueError`` when the file is too short for its own header."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{path.name} has {size} bytes, too few for a safetensors header")
        n = int.from_bytes(prefix, "little")
        if 8 + n > size:
            raise ValueError(
                f"{path.name} is truncated: {size} bytes, its header alone needs {8 + n}"
            )
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise ValueError(f"{path.name} has an unreadable header ({e})") from None
    header.pop("__metadata__", None)
    end = max((entry["data_offsets"][1] for entry in header.values()), default=0)
    return header, 8 + n + end


class CheckpointFiles:
    """The safetensors files of ``directory`` and the tensors in them, from their headers."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)

    @cached_property
    def weight_map(self) -> dict[str, str]:
        """Tensor name -> file name: from the index, or every tensor of the single file."""
        index = self.directory / INDEX
        if index.exists():
            return dict(json.loads(index.read_text())["weight_map"])
        header, _ = read_header(self.directory / SINGLE)
        return dict.fromkeys(header, SINGLE)

    @cached_property
    def entries(self) -> dict[str, TensorEntry]:
        found = {}
        for file in sorted(set(self.weight_map.values())):
            header, _ = read_header(self.directory / file)
            for name, entry in header.items():
                start, end = entry["data_offsets"]
                found[name] = TensorEntry(file, entry["dtype"], tuple(entry["shape"]), end - start)
        return found

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    def problems(self) -> list[str]:
        """A missing file, a truncated file, a name the index maps to a file whose header lacks
        it, and an index whose ``total_size`` disagrees with the files: each named."""
        where = self.directory
        index_path = where / INDEX
        if not index_path.exists() and not (where / SINGLE).exists():
            return [
                f"{where} holds neither {SINGLE} nor {INDEX}: give a directory written by "
                "save_pretrained (safetensors weights), or model.pretrained=false to start "
                "from random weights"
            ]
        try:
            weight_map = self.weight_map
        except (ValueError, KeyError, OSError) as e:
            return [f"{index_path if index_path.exists() else where / SINGLE}: {e}"]
        problems, headers = [], {}
        for file in sorted(set(weight_map.values())):
            path = where / file
            if not path.is_file():
                problems.append(
                    f"{path} is missing (named by {INDEX}): copy the whole "
                    "checkpoint directory again"
                )
                continue
            try:
                header, expected = read_header(path)
            except ValueError as e:
                problems.append(f"{where}/{e}: copy the checkpoint again")
                continue
            actual = path.stat().st_size
            if actual != expected:
                problems.append(
                    f"{path} is truncated: {actual} bytes, its header describes "
                    f"{expected}: copy the checkpoint again"
                )
            headers[file] = header
        for name, file in weight_map.items():
            if file in headers and name not in headers[file]:
                problems.append(
                    f"{INDEX} maps {name} to {file}, whose header lacks it: the "
                    "index and the shards come from different checkpoints"
                )
                break
        if index_path.exists() and len(headers) == len(set(weight_map.values())):
            total = json.loads(index_path.read_text()).get("metadata", {}).get("total_size")
            held = sum(
                e["data_offsets"][1] - e["data_offsets"][0]
                for h in headers.values()
                for e in h.values()
            )
            if total is not None and int(total) != held:
                problems.append(
                    f"{index_path}: total_size={total} but the shards hold {held} "
                    "bytes of tensors: the index and the shards come from different "
                    "checkpoints"
                )
        return problems

    def read(
        self, name: str, box: tuple[slice, ...] | None = None, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """``tensor[box]`` (all of it without ``box``) as ``dtype``, reading only that box."""
        from safetensors import safe_open

        file = self.directory / self.weight_map[name]
        with safe_open(str(file), framework="pt") as f:
            stored = f.get_slice(name)
            view = stored[box] if box is not None else stored[:]
            value = view.to(dtype, copy=True)  # off the mapped file, which closes after this
            del view
        return value


def write_safetensors(
    path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> None:
    """Write ``tensors`` into ``path`` (contiguous CPU copies), fsynced."""
    from safetensors.torch import save_file

    save_file(
        {k: v.detach().contiguous().cpu() for k, v in tensors.items()},
        str(path),
        metadata=metadata or {"format": "pt"},
    )
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
