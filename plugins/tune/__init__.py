"""``tune=default``: what a run reports to a sweep, and the sweepers of plait.

- The objective: ``tune.objective`` names the metric a run hands to the sweeper of ``plait
  train -m`` (its last logged value; default ``eval/loss``, the final validation loss, for
  which a job of a sweep without ``train.eval_every`` evaluates once at its last step).
- ``hydra/sweeper=optuna`` (:mod:`.optuna_sweeper`): Bayesian search on current Optuna with the
  interface of Hydra's Optuna sweeper, a persistent study shared by several sweep workers.
- ``hydra/sweeper=pbt`` (:mod:`.pbt`): population-based training in rounds, each round's
  trials run by whichever Hydra launcher is configured (locally, or on SLURM).

The sweepers are Hydra plugins; Hydra instantiates only classes of the ``hydra_plugins``
namespace, so they are declared in ``hydra_plugins.plait_tune`` (:mod:`.hydra_plugin`, shipped
under that name) and registered with Hydra from ``plait_register_configs``.
"""

from __future__ import annotations

from dataclasses import dataclass

from plait import hookimpl
from plait.config import TuneConfig
from plait.types import PluginInfo


@dataclass
class ObjectiveConfig(TuneConfig):
    name: str = "default"
    objective: str = "eval/loss"  # a logged metric: loss, eval/loss, eval/<task>/acc, ...


@hookimpl
def plait_declare() -> PluginInfo:
    return PluginInfo(
        name="tune",
        selected_by={"tune.name": "default"},
        description="the objective a run reports; Optuna and PBT sweepers",
    )


@hookimpl
def plait_register_configs(config_store) -> None:
    from hydra_plugins.plait_tune import register_with_hydra

    config_store.store(group="tune", name="base_objective", node=ObjectiveConfig)
    register_with_hydra(config_store)


@hookimpl
def plait_configure(cfg) -> None:
    # a job of a sweep without evaluation evaluates once, at its last step, for its objective
    # (a task score, eval/<task>/<metric>, is scored at every job's last step by its plugin)
    in_sweep = cfg.run.sweep is not None
    if in_sweep and cfg.tune.objective == "eval/loss" and not cfg.train.eval_every:
        cfg.train.eval_every = cfg.train.steps


@hookimpl
def plait_objective(cfg, metrics) -> float | None:
    value = metrics.get(cfg.tune.objective)
    return None if value is None else float(value)
