"""plait's Hydra sweepers as Hydra sees them: ``hydra_plugins.plait_tune`` (this directory is
shipped under that name, see pyproject.toml).

Hydra instantiates a sweeper only when its class lives in the ``hydra_plugins`` namespace and
is known to Hydra's plugin registry. An installed wheel is found by Hydra's own scan; an
editable install is not (setuptools' editable finder hides the directory from that scan), so
:func:`register_with_hydra`, called from the tune plugin's ``plait_register_configs``, registers
the classes and stores their configs in either case.
"""

from __future__ import annotations

from hydra.core.plugins import Plugins

from plait.plugins.tune import optuna_sweeper, pbt


class OptunaSweeper(optuna_sweeper.OptunaSweeper):
    """``hydra/sweeper=optuna`` (see :mod:`plait.plugins.tune.optuna_sweeper`)."""


class PBTSweeper(pbt.PBTSweeper):
    """``hydra/sweeper=pbt`` (see :mod:`plait.plugins.tune.pbt`)."""


def register_with_hydra(config_store) -> None:
    for sweeper in (OptunaSweeper, PBTSweeper):
        Plugins.instance().register(sweeper)
    config_store.store(
        group="hydra/sweeper",
        name="optuna",
        provider="plait",
        node=optuna_sweeper.OptunaSweeperConfig,
    )
    for name, node in optuna_sweeper.SAMPLERS.items():
        config_store.store(group="hydra/sweeper/sampler", name=name, provider="plait", node=node)
    config_store.store(
        group="hydra/sweeper", name="pbt", provider="plait", node=pbt.PBTSweeperConfig
    )
