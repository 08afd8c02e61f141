"""A pipeline rank's stages as one module: what the pipeline plugin cuts a model into and what a
strategy's engine wraps (DDP and ZeRO as a whole, FSDP chunk by chunk)."""

from __future__ import annotations

import torch.nn as nn


class PipelineStageModules(nn.Module):
    """This rank's pipeline chunks under the unsplit model's parameter names.

    The model with every part this rank holds (and identities for the others) is registered
    here child by child, so ``state_dict()`` keeps the original names (``plait export`` unites
    the stages' disjoint names) and the optimizer sees every local parameter once. ``chunks``
    lists ``(stage_index, module)`` for the pipeline schedule; each chunk is a copy of the
    model's shell sharing these parts.
    """

    def __init__(self, union: nn.Module, chunks: list[tuple[int, nn.Module]], n_stages: int):
        super().__init__()
        self.n_stages = n_stages
        for name, child in union.named_children():
            self.add_module(name, child)
        self.chunks = chunks  # a plain list: the parts are registered above, once
