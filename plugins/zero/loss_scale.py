"""DeepSpeed's dynamic loss scaler in the layout-free checkpoint copy.

The layout-free form is the one torch's ``GradScaler`` gives under DDP and in a pipeline
(:func:`plait.engine.precision.grad_scaler_state`): ``{"scale", "growth_tracker"}``,
plus ``"hysteresis"``, which only DeepSpeed has. So a checkpoint converted between DDP, a
pipeline and any ZeRO stage continues with the scale it had.

DeepSpeed keeps the scale in one of two objects, both with ``cur_scale``, ``cur_iter`` and
``last_overflow_iter``: ZeRO-1/2/3's ``DynamicLossScaler`` (``optimizer.loss_scaler``, with the
remaining ``cur_hysteresis``) and stage 0's ``FP16_Optimizer``/``FP16_UnfusedOptimizer``'s
``LossScaleConfig`` (``optimizer.loss_scale_config``, no hysteresis). Both grow the scale when
``cur_iter - last_overflow_iter - 1``, the overflow-free steps since the last overflow, is a
positive multiple of the scale window (``loss_scaler.py`` ``update_scale``,
``unfused_optimizer.py`` ``_update_scale``): that count is the growth tracker.
"""

from __future__ import annotations

import torch


def dynamic_loss_scaler(optimizer):
    """The object holding DeepSpeed's dynamic loss scale, or None (fp32, bf16, a static
    scale)."""
    scaler = getattr(optimizer, "loss_scaler", None)  # ZeRO-1/2/3
    if scaler is not None:
        return scaler if getattr(scaler, "dynamic", False) else None
    config = getattr(optimizer, "loss_scale_config", None)  # stage 0, fp16
    return config if getattr(config, "dynamic_loss_scale", False) else None


def loss_scaler_state(scaler) -> dict[str, torch.Tensor]:
    state = {
        "scale": torch.tensor(float(scaler.cur_scale), dtype=torch.float64),
        "growth_tracker": torch.tensor(
            scaler.cur_iter - scaler.last_overflow_iter - 1, dtype=torch.int64
        ),
    }
    if hasattr(scaler, "cur_hysteresis"):
        state["hysteresis"] = torch.tensor(scaler.cur_hysteresis, dtype=torch.int64)
    return state


def load_loss_scaler_state(scaler, state: dict[str, torch.Tensor]) -> None:
    """Continue from another engine's scaler state. The window, factor and hysteresis setting
    stay this engine's; without a saved ``hysteresis`` (torch's scaler has none) the full
    hysteresis this scaler starts with is kept."""
    scaler.cur_scale = float(state["scale"])
    scaler.last_overflow_iter = scaler.cur_iter - 1 - int(state["growth_tracker"])
    if "hysteresis" in state and hasattr(scaler, "cur_hysteresis"):
        scaler.cur_hysteresis = int(state["hysteresis"])
