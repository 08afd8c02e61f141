"""``strategy=local_sgd strategy.sync_every=H``: each data-parallel replica steps on its own and
the replicas' parameters are averaged every H steps (Stich 2019; Lin et al., "Don't use large
mini-batches, use local SGD"). torch's ``PostLocalSGDOptimizer`` and ``PeriodicModelAverager``
do the work (``engine.py``).

    plait train strategy=local_sgd strategy.sync_every=8 optimizer=sgd

With ``optimizer=sgd`` and H=1 this is DDP: SGD's update is linear in the gradient, so
averaging parameters after the step equals averaging gradients before it. AdamW's is not.
"""

from __future__ import annotations

from dataclasses import dataclass

from plait import hookimpl
from plait.config import AT_LEAST_1, StrategyConfig, range_problems
from plait.types import PluginInfo


@dataclass
class LocalSGDConfig(StrategyConfig):
    name: str = "local_sgd"
    sync_every: int = 4  # H: average the replicas' parameters after every H-th step


@hookimpl
def plait_declare() -> PluginInfo:
    return PluginInfo(name="local_sgd", selected_by={"strategy.name": "local_sgd"},
                      parallel_axes=frozenset({"dp"}), precisions=frozenset({"fp32", "bf16"}),
                      description="local SGD: replicas step alone, parameters averaged every H")


@hookimpl
def plait_register_configs(config_store) -> None:
    config_store.store(group="strategy", name="base_local_sgd", node=LocalSGDConfig)


@hookimpl
def plait_validate(cfg) -> list[str]:
    return range_problems("strategy", cfg.strategy, {"sync_every": AT_LEAST_1})


@hookimpl
def plait_build_engine(cfg, model, optimizer, loss_fn, topology):
    from plait.plugins.local_sgd.engine import LocalSGDEngine

    return LocalSGDEngine(cfg, model, optimizer, loss_fn, topology)
