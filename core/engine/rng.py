"""Every random generator the next step may draw from, for this rank: saved with each checkpoint
(``rng_rank<r>.pt``) and handed to a replica group that recovers from a live peer, so both draw
the same dropout masks and samples as the run that saved them.

Taken: torch's CPU generator, Python's ``random``, NumPy's global generator and, where CUDA is
initialised, the CUDA generator of this process's device.
"""

from __future__ import annotations

import random

import numpy as np
import torch


def rng_state() -> dict:
    """Every random generator the next step may draw from, for this rank."""
    _, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": (torch.from_numpy(np.asarray(keys, dtype=np.int64)), pos, has_gauss, gauss),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state) -> None:
    """Put back what :func:`rng_state` returned."""
    if isinstance(state, torch.Tensor):  # checkpoints before every generator was saved
        torch.set_rng_state(state)
        return
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state(("MT19937", keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
