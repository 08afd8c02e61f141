"""Gradient accumulation for engines without a loss scaler: one backward per micro-batch."""

from __future__ import annotations

from typing import Callable

import torch

from plait.types import Batch


def accumulate_gradients(micro_batches: list[Batch],
                         loss_of: Callable[[Batch], torch.Tensor]) -> torch.Tensor:
    """Backward of each micro-batch's loss divided by their number, so the summed gradients
    are those of the mean loss; returns that mean loss, detached."""
    n = len(micro_batches)
    total = torch.zeros(())
    for batch in micro_batches:
        loss = loss_of(batch)
        (loss / n).backward()
        total = total.to(loss.device) + loss.detach()
    return total / n
