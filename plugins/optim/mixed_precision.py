"""Autocast and loss scaling for ``precision=fp32|bf16|fp16``, shared by the torch engines.

bf16 needs no loss scaling; fp16 uses a dynamic ``GradScaler`` (on CUDA, and on the CPU where the
installed torch supports it). fp32 runs without autocast.
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
