"""``strategy=local_sgd strategy.sync_every=H``: each data-parallel replica steps on its own and
the replicas' parameters are averaged every H steps (Stich 2019; Lin et al., "Don't use large
mini-batches, use local SGD"). torch's ``PostLocalSGDOptimizer`` and ``PeriodicModelAverager``
do the work (``engine.py``).

    plait train strategy=local_sgd strategy.sync_every=8 optimizer=sgd
    plait train strategy=local_sgd strategy.sync_every=8 strategy.node_sync_every=1 ...

``strategy.node_sync_every=K`` (0: off) averages the replicas on each node every K steps and all
of them every H (torch's ``HierarchicalModelAverager``): "inside the node every step, across
nodes every H" is K=1.

With ``optimizer=sgd`` and H=1 this is DDP: SGD's update is linear in the gradient, so
averaging parameters after the step equals averaging gradients before it. AdamW's is not.
"""

from __future__ import annotations

from dataclasses import dataclass

from plait import hookimpl
from plait.config import AT_LEAST_1, Range, StrategyConfig, range_problems
from plait.types import PluginInfo


@dataclass
class LocalSGDConfig(StrategyConfig):
    name: str = "local_sgd"
    sync_every: int = 4  # H: average the replicas' parameters after every H-th step
    # K: also average the replicas inside each node after every K-th step (0: off)
    node_sync_every: int = 0


RANGES = {"sync_every": AT_LEAST_1, "node_sync_every": Range(0, meaning="0: off")}


@hookimpl
def plait_declare() -> PluginInfo:
    return PluginInfo(
        name="local_sgd",
        selected_by={"strategy.name": "local_sgd"},
        parallel_axes=frozenset({"dp"}),
        precisions=frozenset({"fp32", "bf16"}),
        description="local SGD: replicas step alone, parameters averaged every H",
    )


@hookimpl
def plait_register_configs(config_store) -> None:
    config_store.store(group="strategy", name="base_local_sgd", node=LocalSGDConfig)


@hookimpl
def plait_validate(cfg) -> list[str]:
    settings = cfg.strategy
    problems = range_problems("strategy", settings, RANGES)
    if settings.node_sync_every >= settings.sync_every > 0:
        problems.append(
            f"strategy.node_sync_every={settings.node_sync_every} must be below "
            f"strategy.sync_every={settings.sync_every}: the average inside each node "
            "runs more often than the one across nodes (0: off)"
        )
    return problems


@hookimpl
def plait_build_engine(cfg, model, optimizer, loss_fn, topology):
    from plait.plugins.local_sgd.engine import LocalSGDEngine

    return LocalSGDEngine(cfg, model, optimizer, loss_fn, topology)
