"""Autocast and loss scaling for ``precision=fp32|bf16|fp16``, shared by the torch engines.

bf16 needs no loss scaling; fp16 uses a dynamic ``GradScaler`` (on CUDA, and on the CPU where the
installed torch supports it). fp32 runs without autocast.

A dynamic loss scaler's state travels in the layout-free checkpoint copy (see
:mod:`plait.engine.layout_free`) as ``{"scale", "growth_tracker"}``: the scale, and
the overflow-free steps counted towards its next growth (torch's ``_growth_tracker``), so another
engine's scaler (DeepSpeed's, ``plait.plugins.zero.loss_scale``) continues where this one was.
"""

from __future__ import annotations

import contextlib

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=DTYPES[precision])


def grad_scaler(precision: str, device: torch.device) -> torch.amp.GradScaler:
    """A scaler that is a no-op unless ``precision == "fp16"``."""
    return torch.amp.GradScaler(device.type, enabled=precision == "fp16")


def grad_scaler_state(scaler: torch.amp.GradScaler) -> dict[str, torch.Tensor]:
    """An enabled ``GradScaler``'s scale and growth tracker, as layout-free tensors."""
    state = scaler.state_dict()
    return {
        "scale": torch.tensor(state["scale"], dtype=torch.float64),
        "growth_tracker": torch.tensor(state["_growth_tracker"], dtype=torch.int64),
    }


def load_grad_scaler_state(scaler: torch.amp.GradScaler, state: dict[str, torch.Tensor]) -> None:
    """Continue from another scaler's :func:`grad_scaler_state` (maybe DeepSpeed's): this
    scaler keeps its own growth interval and factors; a count of overflow-free steps longer
    than the interval is taken modulo it."""
    own = scaler.state_dict()
    scaler.load_state_dict(
        {
            **own,
            "scale": float(state["scale"]),
            "_growth_tracker": int(state["growth_tracker"]) % own["growth_interval"],
        }
    )
