"""Which device this process computes on."""

from __future__ import annotations

import os

import torch

from plait.host_memory import fix_mmap_threshold


def pick_device(requested: str) -> torch.device:
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    if requested == "cpu":
        fix_mmap_threshold()  # tensors on the host go back to the kernel when freed
    return torch.device(requested)
