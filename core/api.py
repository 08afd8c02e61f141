"""The Python entry points behind ``plait train``: one run, or a Hydra multirun of many.

from plait import api

result = api.train(["strategy=zero2", "train.steps=100"])
result.run_dir, result.objective, result.metrics["loss"]
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import IntervalSweep, Override
from hydra.core.utils import JobReturn, JobStatus
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict

from plait.plan import CONFIG_NAME, Plan, hydra_app, make_plan, plan_config
from plait.plugin_manager import PlaitPluginManager, make_plugin_manager
from plait.renames import rename_overrides, renamed_settings
from plait.worker import run_worker


@dataclass
class RunResult:
    """What one run leaves: its directory, the last value of every logged metric, the last
    checkpoint it wrote, and its objective (the number a sweep minimises or maximises: the final
    validation loss, or the metric ``tune.objective`` names; ``None`` when no plugin gives one).

    ``float(result)`` is the objective, so Hydra sweepers that expect a number from the task
    function (Optuna, Nevergrad, Ax) take it as it is. On a node that did not run the logging
    rank (multi-node) metrics are empty and the objective is None.
    """

    run_dir: Path
    metrics: dict[str, float] = field(default_factory=dict)
    checkpoint: Path | None = None
    objective: float | None = None

    def __float__(self) -> float:
        if self.objective is None:
            raise ValueError(
                f"run {self.run_dir} has no objective: no plugin gave one from the "
                f"metrics it logged ({', '.join(sorted(self.metrics)) or 'none'})"
            )
        return float(self.objective)


def train(overrides: Iterable[str] = (), plugins: Iterable[Any] = ()) -> RunResult:
    """Check the plan, write the resolved config into the run directory, launch the workers.

    :param overrides: Hydra overrides, exactly as typed after ``plait train``.
    :param plugins: plugin objects registered from Python (must be picklable: module-level
        classes or modules), in addition to the entry points and the config's ``plugins`` list.
    """
    plugins = tuple(plugins)
    return launch(make_plan(overrides, plugins).check(), plugins)


def train_config(
    cfg: DictConfig, plugins: Iterable[Any] = (), available: PlaitPluginManager | None = None
) -> RunResult:
    """Train with a config Hydra already composed (one job of a sweep). ``available``: a manager
    of every available plugin (``plugins`` among them) the caller already built, not built
    again."""
    plugins = tuple(plugins)
    return launch(plan_config(cfg, plugins, available).check(), plugins)


def launch(plan: Plan, plugins: tuple[Any, ...]) -> RunResult:
    cfg = plan.cfg
    run_dir = Path(cfg.run.dir)
    if int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0))) == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(cfg, run_dir / "config.yaml")
    config = OmegaConf.to_container(cfg, resolve=True)
    returned = plan.pm.hook.plait_launch(
        cfg=cfg, dims=plan.dims, entrypoint=run_worker, args=(config, plugins), hook=plan.pm.hook
    )
    # the logging rank returns what it saw; every other worker returns None
    summary: dict = next((r for r in (returned or {}).values() if r), {})
    metrics = summary.get("metrics", {})
    checkpoint = summary.get("checkpoint")
    objective = plan.pm.hook.plait_objective(cfg=cfg, metrics=metrics) if metrics else None
    return RunResult(run_dir, metrics, Path(checkpoint) if checkpoint else None, objective)


# ---------------------------------------------------------------------------------------------
# plait train -m: Hydra's own multirun
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SweepJob:
    """Hydra's task function for ``plait train -m``: one job is one plait run.

    The job's run directory is the directory Hydra gives the job (``hydra.sweep.dir``, which
    plait's config sets to ``${run.root}/${run.name}``, plus ``hydra.sweep.subdir``, the job
    number unless a sweeper sets it), so the run's files sit beside Hydra's record of the job;
    ``run.sweep`` names the sweep (trackers group by it) and ``run.name`` becomes
    ``<sweep>/<subdir>``. Picklable, so launchers that run jobs elsewhere (submitit) take it.
    """

    plugins: tuple[Any, ...] = ()

    def __call__(self, cfg: DictConfig) -> RunResult:
        hydra = HydraConfig.get()
        output_dir = Path(hydra.runtime.output_dir)
        sweep = Path(hydra.sweep.dir).name
        with open_dict(cfg):
            cfg.run.sweep = sweep
            cfg.run.name = f"{sweep}/{output_dir.relative_to(Path(hydra.sweep.dir).absolute())}"
            cfg.run.dir = str(output_dir)
        return train_config(cfg, self.plugins)


def multirun(
    overrides: Iterable[str] = (),
    plugins: Iterable[Any] = (),
    config_dir: str | None = None,
    config_name: str | None = None,
) -> Any:
    """Run a sweep through ``Hydra.multirun``: the sweeper (``hydra/sweeper=...``, default
    Hydra's basic grid) makes the jobs and the launcher (``hydra/launcher=...``) runs them.

    :return: what the sweeper returns (Hydra's basic sweeper: the ``JobReturn`` of every job,
        batch by batch; each ``return_value`` is a :class:`RunResult`).
    """
    plugins = tuple(plugins)
    pm = make_plugin_manager(objects=plugins)
    overrides = rename_overrides(overrides, renamed_settings(pm))  # a sweep's too
    with hydra_app(pm, config_dir) as hydra:
        check_sweep(hydra, config_name or CONFIG_NAME, overrides, plugins)
        return hydra.multirun(config_name or CONFIG_NAME, SweepJob(plugins), overrides)


def check_sweep(
    hydra: Any, config_name: str, overrides: list[str], plugins: tuple[Any, ...]
) -> None:
    """Refuse a sweep before any job starts or is submitted (``PlanError``, nothing written):
    every swept setting is checked at each of its values (an interval at both ends) with the
    others at their first. A combination of values refused only together is refused when its
    job starts."""
    parsed = OverridesParser.create().parse_overrides(overrides)
    values = [sweep_values(o) for o in parsed]
    first = [v[0] for v in values]
    jobs = [first] + [
        first[:i] + [value] + first[i + 1 :]
        for i, choices in enumerate(values)
        for value in choices[1:]
    ]
    for job in jobs:
        cfg = hydra.compose_config(
            config_name, job, run_mode=RunMode.RUN, with_log_configuration=False
        )
        with open_dict(cfg):
            del cfg["hydra"]
            cfg.run.sweep = cfg.run.name = str(cfg.run.name)  # as SweepJob gives them
        plan_config(cfg, plugins).check()


def sweep_values(override: Override) -> list[str]:
    """``key=value`` for each value a swept override takes (the override itself if not swept)."""
    if not override.is_sweep_override():
        return [str(override.input_line)]
    key, sweep = override.get_key_element(), override.value()
    if isinstance(sweep, IntervalSweep):
        return [f"{key}={sweep.start}", f"{key}={sweep.end}"]
    return [
        f"{key}={override._get_value_element_as_str(value)}" for value in override.sweep_iterator()
    ]


def job_returns(swept: Any) -> list:
    """The jobs of a sweep whose sweeper returns them batch by batch (Hydra's basic sweeper)."""
    if not isinstance(swept, list):
        return []
    return [
        job
        for batch in swept
        if isinstance(batch, (list, tuple))
        for job in batch
        if isinstance(job, JobReturn)
        and job.status == JobStatus.COMPLETED
        and isinstance(job.return_value, RunResult)
    ]
