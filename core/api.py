"""The Python entry points behind ``plait train`` and ``plait plan``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable

from omegaconf import OmegaConf

from plait.plan import make_plan
from plait.worker import run_worker


def train(overrides: Iterable[str] = (), plugins: Iterable[Any] = ()) -> Path:
    """Check the plan, write the resolved config into the run directory, launch the workers.

    :param overrides: Hydra overrides, exactly as typed after ``plait train``.
    :param plugins: plugin objects registered from Python (must be picklable: module-level
        classes or modules), in addition to the entry points and the config's ``plugins`` list.
    :return: the run directory.
    """
    plugins = tuple(plugins)
    plan = make_plan(overrides, plugins).check()
    cfg = plan.cfg
    run_dir = Path(cfg.run.dir)
    if int(os.environ.get("RANK", 0)) == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(cfg, run_dir / "config.yaml")
    config = OmegaConf.to_container(cfg, resolve=True)
    plan.pm.hook.plait_launch(cfg=cfg, entrypoint=run_worker, args=(config, plugins))
    return run_dir
