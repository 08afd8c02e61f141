"""Which device this process computes on."""

from __future__ import annotations

import os

import torch

from plait.host_memory import DECOMMIT_ABOVE, configure_worker


def pick_device(
    requested: str, allocator: str = "auto", decommit_above: float = DECOMMIT_ABOVE
) -> torch.device:
    """The device this rank computes on; on the host, the allocator's in-process part
    (``launcher.allocator``, ``launcher.decommit_above``, :mod:`plait.host_memory`)."""
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    if requested == "cpu":
        configure_worker(allocator, decommit_above)
    return torch.device(requested)
