"""The random state of each rank, saved with every checkpoint (``rng_rank<r>.pt``) so that a
resumed run draws the same dropout masks and samples as the uninterrupted one.

What is saved is the engine library's :func:`plait.engine.rng.rng_state`: torch's CPU
generator, Python's ``random``, NumPy's global generator and, where CUDA is initialised, the CUDA
generator of this process's device.
"""

from __future__ import annotations

from pathlib import Path

import torch

from plait.engine.rng import rng_state, set_rng_state

RNG_FILE = "rng_rank{}.pt"


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
