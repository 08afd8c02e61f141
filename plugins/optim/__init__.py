"""AdamW with decoupled weight decay on matrices only, and a cosine schedule with linear warm-up
(nanoGPT's ``get_lr``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from plait import hookimpl
from plait.config import AT_LEAST_0, AT_LEAST_1, OptimizerConfig, Range, range_problems
from plait.types import PluginInfo


@dataclass
class AdamWConfig(OptimizerConfig):
    name: str = "adamw"
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 10
    decay_steps: Optional[int] = None  # None: train.steps
    weight_decay: float = 0.1
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    fused: Optional[bool] = None  # None: fused on CUDA, plain elsewhere


# torch.optim.AdamW's own rules (lr, eps, weight_decay >= 0, betas in [0, 1)), and the schedule's.
RANGES = {
    "lr": AT_LEAST_0,
    "min_lr": AT_LEAST_0,
    "weight_decay": AT_LEAST_0,
    "eps": AT_LEAST_0,
    "betas": Range(0, 1, high_open=True),
    "decay_steps": AT_LEAST_1,
    "warmup_steps": Range(0, meaning="0: no warm-up"),
}


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay weights of dimension >= 2 (matmuls, embeddings); not biases or norms."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if dims(p) >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if dims(p) < 2], "weight_decay": 0.0},
    ]


def dims(p: torch.nn.Parameter) -> int:
    """The parameter's own number of dimensions, also when a ZeRO-3 partition stands in for it
    (DeepSpeed leaves an empty 1-D tensor and keeps the shape as ``ds_shape``)."""
    return len(getattr(p, "ds_shape", p.shape))


def cosine_with_warmup(lr: float, min_lr: float, warmup: int, decay: int) -> Callable[[int], float]:
    def lr_at(step: int) -> float:
        if step < warmup:
            return lr * (step + 1) / warmup
        if step >= decay:
            return min_lr
        progress = (step - warmup) / max(1, decay - warmup)
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)

    return lr_at


@hookimpl
def plait_declare() -> PluginInfo:
    return PluginInfo(
        name="adamw",
        selected_by={"optimizer.name": "adamw"},
        description="torch AdamW + cosine schedule with warm-up",
    )


@hookimpl
def plait_register_configs(config_store) -> None:
    config_store.store(group="optimizer", name="base_adamw", node=AdamWConfig)


@hookimpl
def plait_validate(cfg) -> list[str]:
    opt = cfg.optimizer
    problems = range_problems("optimizer", opt, RANGES)
    if len(opt.betas) != 2:
        problems.append(
            f"optimizer.betas={opt.betas} needs two numbers (beta1, beta2), e.g. "
            "optimizer.betas=[0.9,0.95]"
        )
    return problems


@hookimpl
def plait_build_optimizer(cfg, model) -> torch.optim.Optimizer:
    opt = cfg.optimizer
    on_cuda = next(model.parameters()).is_cuda or (
        cfg.device in ("cuda", "auto") and torch.cuda.is_available()
    )
    fused = opt.fused if opt.fused is not None else on_cuda
    return torch.optim.AdamW(
        param_groups(model, opt.weight_decay),
        lr=opt.lr,
        betas=tuple(opt.betas),
        eps=opt.eps,
        fused=fused or None,
    )


@hookimpl
def plait_build_lr_schedule(cfg) -> Callable[[int], float]:
    opt = cfg.optimizer
    decay = opt.decay_steps if opt.decay_steps is not None else cfg.train.steps
    return cosine_with_warmup(opt.lr, opt.min_lr, opt.warmup_steps, decay)
