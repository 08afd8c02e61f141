"""``optimizer=sgd``: torch SGD (momentum, Nesterov, weight decay) with the same cosine schedule
and warm-up as AdamW. Its update is linear in the gradient, so averaging parameters after a step
(local SGD, DiLoCo with H=1) is the same as averaging gradients before it (DDP)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from plait import hookimpl
from plait.config import AT_LEAST_0, AT_LEAST_1, OptimizerConfig, Range, range_problems
from plait.plugins.optim import cosine_with_warmup, param_groups
from plait.types import PluginInfo


@dataclass
class SGDConfig(OptimizerConfig):
    name: str = "sgd"
    lr: float = 0.1
    min_lr: float = 0.01
    warmup_steps: int = 10
    decay_steps: Optional[int] = None  # None: train.steps
    momentum: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0  # on matrices only, as AdamW's


# torch.optim.SGD's own rules, and the schedule's.
RANGES = {
    "lr": AT_LEAST_0,
    "min_lr": AT_LEAST_0,
    "momentum": Range(0, 1, high_open=True),
    "weight_decay": AT_LEAST_0,
    "decay_steps": AT_LEAST_1,
    "warmup_steps": Range(0, meaning="0: no warm-up"),
}


@hookimpl
def plait_declare() -> PluginInfo:
    return PluginInfo(
        name="sgd",
        selected_by={"optimizer.name": "sgd"},
        description="torch SGD (momentum, Nesterov) + cosine schedule with warm-up",
    )


@hookimpl
def plait_register_configs(config_store) -> None:
    config_store.store(group="optimizer", name="base_sgd", node=SGDConfig)


@hookimpl
def plait_validate(cfg) -> list[str]:
    opt = cfg.optimizer
    problems = range_problems("optimizer", opt, RANGES)
    if opt.nesterov and opt.momentum == 0:
        problems.append(
            "optimizer.nesterov=true needs momentum: set optimizer.momentum > 0 "
            "(e.g. 0.9) or optimizer.nesterov=false"
        )
    return problems


@hookimpl
def plait_build_optimizer(cfg, model) -> torch.optim.Optimizer:
    opt = cfg.optimizer
    return torch.optim.SGD(
        param_groups(model, opt.weight_decay),
        lr=opt.lr,
        momentum=opt.momentum,
        nesterov=opt.nesterov,
    )


@hookimpl
def plait_build_lr_schedule(cfg) -> Callable[[int], float]:
    opt = cfg.optimizer
    decay = opt.decay_steps if opt.decay_steps is not None else cfg.train.steps
    return cosine_with_warmup(opt.lr, opt.min_lr, opt.warmup_steps, decay)
