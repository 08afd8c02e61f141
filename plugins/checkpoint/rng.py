"""The random state of each rank, saved with every checkpoint (``rng_rank<r>.pt``) so that a
resumed run draws the same dropout masks and samples as the uninterrupted one.

Saved: torch's CPU generator, Python's ``random``, NumPy's global generator and, where CUDA is
initialised, the CUDA generator of this process's device.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch

RNG_FILE = "rng_rank{}.pt"


def rng_state() -> dict:
    """Every random generator the next step may draw from, for this rank."""
    _, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": (torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss),
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


def save_rng(directory: Path, rank: int) -> None:
    torch.save(rng_state(), directory / RNG_FILE.format(rank))


def load_rng(directory: Path, rank: int, required: bool) -> None:
    """Restore this rank's random state from ``directory``. ``required``: the checkpoint was
    written by the same ranks (its layout is this run's), so the file must be there: a missing
    one is an error, never a silent fresh random state. A checkpoint converted from another
    layout holds only the ranks it was written with: a rank it lacks keeps its seeded state."""
    file = directory / RNG_FILE.format(rank)
    if not file.exists():
        if required:
            raise FileNotFoundError(
                f"checkpoint {directory} has no {file.name}: rank {rank}'s random state was not "
                "saved with it (a damaged or hand-edited checkpoint), and resuming without it "
                "would not continue the run exactly; resume from another checkpoint, or start "
                "fresh with resume=null and another run.name"
            )
        return
    set_rng_state(torch.load(file, weights_only=True))
