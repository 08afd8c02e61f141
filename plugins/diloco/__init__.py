"""``strategy=diloco``: DiLoCo (Douillard et al. 2023, "DiLoCo: Distributed Low-Communication
Training of Language Models"): each replica runs the run's optimizer (AdamW) for H inner steps,
then one outer Nesterov step on the averaged pseudo-gradient (``outer.py``).

    plait train strategy=diloco strategy.sync_every=500 strategy.outer_lr=0.7

Defaults are the paper's: H=500, outer lr 0.7, outer momentum 0.9.
"""

from __future__ import annotations

from dataclasses import dataclass

from plait import hookimpl
from plait.config import AT_LEAST_0, AT_LEAST_1, Range, StrategyConfig, range_problems
from plait.types import PluginInfo

RANGES = {
    "sync_every": AT_LEAST_1,
    "outer_lr": AT_LEAST_0,
    "outer_momentum": Range(0, 1, high_open=True),
}


@dataclass
class DiLoCoConfig(StrategyConfig):
    name: str = "diloco"
    sync_every: int = 500  # H: inner steps between outer steps
    outer_lr: float = 0.7
    outer_momentum: float = 0.9  # Nesterov; 0: plain SGD


@hookimpl
def plait_declare() -> PluginInfo:
    return PluginInfo(
        name="diloco",
        selected_by={"strategy.name": "diloco"},
        parallel_axes=frozenset({"dp"}),
        precisions=frozenset({"fp32", "bf16"}),
        description="DiLoCo: H inner steps, outer Nesterov on the pseudo-gradient",
    )


@hookimpl
def plait_register_configs(config_store) -> None:
    config_store.store(group="strategy", name="base_diloco", node=DiLoCoConfig)


@hookimpl
def plait_validate(cfg) -> list[str]:
    return range_problems("strategy", cfg.strategy, RANGES)


@hookimpl
def plait_build_engine(cfg, model, optimizer, loss_fn, topology):
    from plait.plugins.diloco.outer import DiLoCoEngine

    return DiLoCoEngine(cfg, model, optimizer, loss_fn, topology)
