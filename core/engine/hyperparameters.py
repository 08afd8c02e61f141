"""The run's hyperparameters in the optimizer's param groups: the schedule's learning rate set
before every step (:func:`set_lr`), and the run's own settings kept over a loaded checkpoint
(:func:`keep_hyperparameters`).

The learning rate is plait's schedule (the optimizer plugin's ``plait_build_lr_schedule``),
written into every param group before each step by every engine alike, DeepSpeed's included,
so a run's per-step learning rate does not depend on the strategy.

``torch.optim.Optimizer.load_state_dict`` (and DeepSpeed's ZeRO optimizers, which call it on the
optimizer they wrap) replaces every param group's settings (betas, weight decay, eps, ...) with
the checkpoint's. A run that resumes with other settings — a PBT child with perturbed
hyperparameters, a fine-tune with a new weight decay — would silently train with the old ones.
The engines load inside :func:`keep_hyperparameters`, so the optimizer state (moments, step
counts) comes from the checkpoint and the settings from the config, as the learning rate
already does (the loop sets it every step).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """This step's learning rate into every param group of ``optimizer``."""
    for group in optimizer.param_groups:
        group["lr"] = lr


@contextmanager
def keep_hyperparameters(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Restore each param group's settings (all but ``params``) after the body loads a state."""
    kept = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    yield
    if len(kept) != len(optimizer.param_groups):
        raise ValueError(
            f"the checkpoint's optimizer has {len(optimizer.param_groups)} param "
            f"groups, this run's {len(kept)}: it was written for another optimizer"
        )
    for group, settings in zip(optimizer.param_groups, kept):
        group.update(settings)
