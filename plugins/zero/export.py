"""Read a ZeRO checkpoint's model weights offline, for ``plait export``.

DeepSpeed writes ``<checkpoint>/deepspeed/`` with ``*mp_rank_<tp>_model_states.pt`` and, for
ZeRO-1..3, one ``*_optim_states.pt`` per data-parallel rank holding that rank's fp32 partition.
DeepSpeed's zero-to-fp32 path joins the partitions; it reads one tensor-parallel rank per folder,
so each tensor-parallel rank's files are linked into a folder of their own first.

A checkpoint with a layout-free copy (every checkpoint plait writes under ZeRO: the strategy
provides ``engine:layout_free_state``) is read from that copy, which holds every parameter whole
by the unsplit model's names (:func:`plait.engine.layout_free.read_model`): DeepSpeed's
``mp_rank`` files number its model-parallel ranks, which under pipeline stages are stages, not
tensor-parallel shards. DeepSpeed's own files are read for a checkpoint without that copy.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import torch

from plait.engine.layout_free import DIRECTORY, read_model
from plait.plugins.zero.engine import TAG

MP_RANK = re.compile(r"mp_rank_(\d+)_")


def tensor_parallel_ranks(ds_dir: Path) -> list[int]:
    ranks = {
        int(m.group(1)) for p in ds_dir.glob("*_model_states.pt") if (m := MP_RANK.search(p.name))
    }
    if not ranks:
        raise ValueError(
            f"{ds_dir}: no DeepSpeed model states in it; was it written by strategy=zero0..zero3?"
        )
    return sorted(ranks)


def read_stage0(ds_dir: Path, tp_rank: int) -> dict[str, torch.Tensor]:
    state = torch.load(
        ds_dir / f"mp_rank_{tp_rank:02d}_model_states.pt", map_location="cpu", weights_only=False
    )
    return {k: v.float() for k, v in state["module"].items()}


def read_partitioned(ds_dir: Path, tp_rank: int) -> dict[str, torch.Tensor]:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        one_rank = Path(tmp) / TAG
        one_rank.mkdir()
        for path in ds_dir.glob(f"*mp_rank_{tp_rank:02d}_*.pt"):
            (one_rank / path.name).symlink_to(path.resolve())
        state = get_fp32_state_dict_from_zero_checkpoint(tmp, tag=TAG)
    return {k: v.float() for k, v in state.items()}


def read_model_shards(checkpoint: Path, stage: int) -> dict[tuple[int, int], dict]:
    if (checkpoint / DIRECTORY).exists():
        return {(0, 0): read_model(checkpoint)}
    ds_dir = checkpoint / TAG
    read = read_stage0 if stage == 0 else read_partitioned
    return {(0, tp): read(ds_dir, tp) for tp in tensor_parallel_ranks(ds_dir)}
