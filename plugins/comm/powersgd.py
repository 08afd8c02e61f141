"""``comm.compression=powersgd``: torch's PowerSGD (Vogels et al. 2019,
``ddp_comm_hooks/powerSGD_hook.py``), with its error feedback and warm start.

Each gradient matrix ``M`` (n x m) is sent as two rank-r factors: ``P = M Q`` is all-reduced and
orthogonalised, then ``Q = M^T P`` is all-reduced, and ``M ~ P Q^T``; vectors (biases, norms) and
matrices too small to gain go uncompressed. The error ``M - P Q^T`` of each step is added to the
next step's gradient on the same rank (error feedback), so nothing is lost, only delayed. The
first ``comm.powersgd_start_iter`` steps all-reduce uncompressed (torch needs at least 2: DDP
rebuilds its buckets after the first step).
"""

from __future__ import annotations

from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook


def powersgd_hook(group, rank: int, start_iter: int, seed: int):
    """``(hook, state)`` in DDP's comm-hook form; ``group`` may be an algorithm's group. The same
    seed on every rank gives every rank the same random projections."""
    state = powerSGD_hook.PowerSGDState(
        process_group=group,
        matrix_approximation_rank=rank,
        start_powerSGD_iter=start_iter,
        random_seed=seed,
    )
    return powerSGD_hook.powerSGD_hook, state
