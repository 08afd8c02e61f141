"""The accumulation that keeps an elastic job's global batch at every size it runs at."""

from __future__ import annotations

import math

from plait.topology.dims import ParallelDims, configured_grad_accum_steps


def elastic_grad_accum_steps(cfg, dims: ParallelDims, local_world_size: int) -> int:
    """``train.grad_accum_steps`` at the world size of ``dims`` (a job's layout at some size of
    ``dims.nodes``); :meth:`Topology.initialize` stores it as ``dims.grad_accum_steps``.

    In an elastic job (``launcher.nnodes=MIN:MAX``) ``train.batch_size`` and
    ``train.grad_accum_steps`` are given for MAX nodes. At fewer nodes the per-rank micro-batch
    stays as it is and the accumulation grows by ``dp_at_MAX / dp``, so that every step still
    takes the global batch::

        train.batch_size = micro_batch_size x grad_accum_steps x dp      (at every size)
        grad_accum_steps(dp) = train.grad_accum_steps x dp_at_MAX / dp

    A job of fixed size keeps ``train.grad_accum_steps``. ``ValueError`` when ``dp`` does not
    divide ``train.grad_accum_steps x dp_at_MAX`` (refused before launch for every size in the
    range).
    """
    nodes = dims.nodes
    if not nodes.elastic:
        return configured_grad_accum_steps(cfg)
    full = ParallelDims.from_config(cfg, world_size=nodes.max * local_world_size, nodes=nodes)
    micro_batches = cfg.train.grad_accum_steps * full.dp  # per step, over all dp ranks
    if micro_batches % dims.dp:
        nodes_now = dims.world_size // local_world_size
        raise ValueError(
            f"launcher.nnodes={cfg.launcher.nnodes}: at {nodes_now} node(s) dp is {dims.dp}, "
            f"which cannot share the {micro_batches} micro-batches of a step (train."
            f"grad_accum_steps={cfg.train.grad_accum_steps} x dp {full.dp} at {nodes.max} "
            f"nodes), so train.batch_size={cfg.train.batch_size} cannot be kept: set "
            f"train.grad_accum_steps to a multiple of {dims.dp // math.gcd(full.dp, dims.dp)} "
            "(and train.batch_size to match), or narrow launcher.nnodes"
        )
    return micro_batches // dims.dp
