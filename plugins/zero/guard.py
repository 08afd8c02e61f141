"""The step guard (``plait_check_step``) inside DeepSpeed's optimizer step.

DeepSpeed's ZeRO optimizers compute the global gradient norm at the start of ``step()`` and, when
it is not finite, take their own overflow path: the gradients and partition buffers are cleared,
the optimizer states and fp32 master weights are not touched, and the engine counts the step in
``skipped_steps`` (``stage_1_and_2.py`` and ``stage3.py`` ``step``, ``engine.py``
``_take_model_step``). The guard wraps that norm computation: the norm DeepSpeed computed
(divided by the loss scale) goes to ``plait_check_step`` with the step's loss, and when a guard
answers "skip" the optimizer's ``overflow`` flag is raised, so DeepSpeed skips through that same
path. No second pass over the gradients; the norm is the same on every rank (DeepSpeed all-reduces
it) and the step guard agrees on its answer over the trainer group, so every rank skips together.

Under fp16 the guards judge the loss alone, as under DDP: a gradient overflow is the loss
scaler's (DeepSpeed checks it before the norm, skips the step and lowers the scale). When
DeepSpeed skipped on such an overflow before computing the norm, the guards are asked after its
step, with the loss alone (:meth:`DeepSpeedStepGuard.settle`), so a NaN loss still counts
towards ``fault.max_bad_steps``. A forced skip under fp16 lowers the scale too, as every overflow
does in DeepSpeed's ZeRO optimizers.

Stage 0 in fp32 steps the torch optimizer directly: its ``step`` is wrapped instead, after
DeepSpeed (or plait, without clipping) measured the norm. Stage 0 in bf16/fp16 steps DeepSpeed's
``FP16_UnfusedOptimizer`` (``FP16_Optimizer`` with a fused Adam) around the torch optimizer: it
checks every gradient for inf/NaN first (``overflow_checker``, agreed over the model-parallel
group; the gradients were already averaged over dp) and skips such a step itself, then computes
the norm (kept in ``_global_grad_norm``), unscales and clips, and steps the torch optimizer. The
torch optimizer's ``step`` is wrapped there too, with that norm; a "skip" raises the wrapper's
``overflow`` flag, so DeepSpeed's engine counts the step in ``skipped_steps`` as on an overflow.
A step DeepSpeed skipped itself is settled as above, with a non-finite norm (in bf16, where the
loss is not scaled, that check finds NaN/inf gradients only, a bad step). As under DDP, a forced
skip under fp16 is not an overflow here: the scale is not lowered.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from plait.engine.step import ask_guard


class DeepSpeedStepGuard:
    """Asks ``check(loss=..., grad_norm=...)`` (the ``plait_check_step`` results) once per
    optimizer step of ``optimizer`` (DeepSpeed's), and makes DeepSpeed skip the step when any
    answer is True. ``stage0_norm()`` gives the norm where DeepSpeed steps a torch optimizer."""

    def __init__(
        self,
        optimizer,
        check: Callable[..., list],
        stage0_norm: Callable[[], float],
        loss_scaled: bool,
    ):
        from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
        from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
        from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

        self.optimizer, self.check, self.loss_scaled = optimizer, check, loss_scaled
        self.loss: torch.Tensor | None = None
        self.skipped = False
        if isinstance(optimizer, DeepSpeedZeroOptimizer):
            self._wrap(optimizer, "scaled_global_norm", self._norm_stage_1_2)
        elif isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3):
            self._wrap(optimizer, "_get_norm_groups", self._norm_groups_stage_3)
        elif isinstance(optimizer, torch.optim.Optimizer):  # stage 0, fp32: the torch optimizer
            self.stage0_norm = stage0_norm
            self._wrap(optimizer, "step", self._step_stage_0)
        elif isinstance(optimizer, (FP16_Optimizer, FP16_UnfusedOptimizer)):  # stage 0, 16 bits
            self._wrap(
                optimizer.optimizer,
                "step",
                functools.partial(self._step_stage_0_16_bits, optimizer),
            )
        else:  # a DeepSpeed optimizer plait does not configure (e.g. its BF16_Optimizer)
            self.arm = lambda loss: None

    @staticmethod
    def _wrap(optimizer, name: str, wrapper: Callable) -> None:
        setattr(optimizer, name, functools.partial(wrapper, optimizer, getattr(optimizer, name)))

    def arm(self, loss: torch.Tensor) -> None:
        """Before DeepSpeed's step: the step's mean loss on this rank (a 0-d tensor)."""
        self.loss, self.skipped = loss, False

    def settle(self) -> bool:
        """After DeepSpeed's step: True when the guards skipped it. Asks them, with the loss
        and a non-finite norm (which fp16 ignores), if DeepSpeed's own overflow check skipped
        the step before they were asked."""
        if self.loss is not None and getattr(self.optimizer, "overflow", False):
            self._ask(torch.tensor(float("inf")))  # under fp16 only the loss is judged
        self.loss = None
        return self.skipped

    def _ask(self, grad_norm: torch.Tensor) -> bool:
        if self.loss is None:  # a step plait did not arm: not a train step of its loop
            return False
        self.skipped = ask_guard(self.check, self.loss, grad_norm, self.loss_scaled)
        self.loss = None
        return self.skipped

    def _norm_stage_1_2(self, optimizer, scaled_global_norm, *args, **kwargs):
        norm = scaled_global_norm(*args, **kwargs)
        if self._ask(torch.as_tensor(norm, dtype=torch.float32) / optimizer.loss_scale):
            optimizer.overflow = True  # read right after: DeepSpeed's overflow path
        return norm

    def _norm_groups_stage_3(self, optimizer, get_norm_groups):
        from deepspeed.runtime.utils import combine_grad_norm_groups

        groups = get_norm_groups()
        norm = combine_grad_norm_groups(groups)
        if self._ask(torch.as_tensor(norm, dtype=torch.float32) / optimizer.loss_scale):
            optimizer.overflow = True
        return groups

    def _step_stage_0(self, optimizer, step, *args, **kwargs):
        if self._ask(torch.tensor(self.stage0_norm(), dtype=torch.float32)):
            return None  # DeepSpeed's engine clears the gradients after the step
        return step(*args, **kwargs)

    def _step_stage_0_16_bits(self, wrapper, torch_optimizer, step, *args, **kwargs):
        """The torch optimizer's step inside DeepSpeed's 16-bit wrapper, with the norm the
        wrapper computed (the unfused one keeps it loss-scaled: under fp16 the guards do not
        read it). On a skip the wrapper still copies its fp32 master weights, unchanged, into
        the 16-bit parameters."""
        if self._ask(torch.tensor(float(wrapper._global_grad_norm), dtype=torch.float32)):
            wrapper.overflow = True
            return None
        return step(*args, **kwargs)
