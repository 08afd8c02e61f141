"""``hydra/sweeper=optuna``: Bayesian search (TPE by default) on current Optuna, with the interface
of Hydra's Optuna sweeper.

    plait train -m hydra/sweeper=optuna hydra.sweeper.n_trials=20 \\
        hydra.sweeper.storage=sweeps/lr.journal hydra.sweeper.study_name=lr \\
        'optimizer.lr=tag(log,interval(1e-4,1e-2))' 'train.batch_size=choice(8,16)'

Why plait's own and not ``hydra-optuna-sweeper``: that plugin pins ``optuna<3`` (unmaintained
since 2022, before the journal storage and with distributions Optuna has since removed), and its
RDB storage fails with SQLAlchemy 2, which current wandb/alembic environments bring. This
sweeper keeps its user-facing interface (``hydra/sweeper=optuna``, ``hydra.sweeper.n_trials``,
``direction``, ``storage``, ``study_name``, ``n_jobs``, ``sampler``, ``params``,
``custom_search_space``, the ``interval``/``choice``/``range``/``tag(log, ...)`` syntax) and runs
on Optuna's ask-and-tell interface, so each batch of trials goes through whichever Hydra launcher
is configured (locally, or SLURM through submitit). What differs, on purpose:

- ``n_trials`` is the study's total of complete (or pruned) trials, counted from the storage,
  not this invocation's: a stopped sweep started again with the same ``storage`` and
  ``study_name`` runs only the missing trials, and several workers sharing one study stop
  together (a trial running in another worker counts; a trial left running by a killed sweep
  on this host is told failed, so a new one takes its place). Failed trials do not count; a
  sweep stops after ``n_trials`` failures of its own.
- ``storage`` takes a database URL (``sqlite:///sweeps.db``, ``postgresql://...``) or a file
  path, which becomes Optuna's journal storage: an append-only log that several processes (on
  several machines, over a shared file system) can use at once without a database server.
- A trial that fails (a crashed run, a refused plan) is told to Optuna as failed and the sweep
  goes on, instead of stopping the whole sweep.
- Each trial's run directory is named by its trial number, unique within the study, so workers
  (and restarts) sharing a ``run.name`` never write into each other's runs.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from hydra.core.plugins import Plugins
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from hydra.utils import get_method
from omegaconf import MISSING, DictConfig, OmegaConf

from plait.plugins.tune.search_space import as_overrides, parse

log = logging.getLogger(__name__)

WORKER = "plait_worker"  # trial user attribute: host:pid of the sweep process running it


# ---------------------------------------------------------------------------------------------
# configs: hydra/sweeper=optuna, hydra/sweeper/sampler=tpe|random|cmaes|nsgaii|qmc|gp|grid
# ---------------------------------------------------------------------------------------------


@dataclass
class TPESamplerConfig:
    _target_: str = "optuna.samplers.TPESampler"
    seed: Optional[int] = None
    n_startup_trials: int = 10
    n_ei_candidates: int = 24
    multivariate: bool = False
    group: bool = False
    constant_liar: bool = True  # parallel trials do not all sample the same point
    warn_independent_sampling: bool = True


@dataclass
class RandomSamplerConfig:
    _target_: str = "optuna.samplers.RandomSampler"
    seed: Optional[int] = None


@dataclass
class CmaEsSamplerConfig:
    _target_: str = "optuna.samplers.CmaEsSampler"
    seed: Optional[int] = None
    x0: Optional[dict[str, Any]] = None
    sigma0: Optional[float] = None
    n_startup_trials: int = 1
    restart_strategy: Optional[str] = None
    popsize: Optional[int] = None
    inc_popsize: int = -1
    use_separable_cma: bool = False
    with_margin: bool = False
    lr_adapt: bool = False
    consider_pruned_trials: bool = False


@dataclass
class NSGAIISamplerConfig:
    _target_: str = "optuna.samplers.NSGAIISampler"
    seed: Optional[int] = None
    population_size: int = 50
    mutation_prob: Optional[float] = None
    crossover_prob: float = 0.9
    swapping_prob: float = 0.5


@dataclass
class QMCSamplerConfig:
    _target_: str = "optuna.samplers.QMCSampler"
    seed: Optional[int] = None
    qmc_type: str = "sobol"
    scramble: bool = False


@dataclass
class GPSamplerConfig:
    _target_: str = "optuna.samplers.GPSampler"
    seed: Optional[int] = None
    n_startup_trials: int = 10
    deterministic_objective: bool = False


@dataclass
class GridSamplerConfig:
    _target_: str = "optuna.samplers.GridSampler"
    _partial_: bool = True  # the grid comes from the sweep's choices at run time
    seed: Optional[int] = None


SAMPLERS = {
    "tpe": TPESamplerConfig,
    "random": RandomSamplerConfig,
    "cmaes": CmaEsSamplerConfig,
    "nsgaii": NSGAIISamplerConfig,
    "qmc": QMCSamplerConfig,
    "gp": GPSamplerConfig,
    "grid": GridSamplerConfig,
}


@dataclass
class OptunaSweeperConfig:
    _target_: str = "hydra_plugins.plait_tune.OptunaSweeper"
    defaults: list[Any] = field(default_factory=lambda: [{"sampler": "tpe"}])
    sampler: Any = MISSING
    direction: str = "minimize"  # or maximize
    storage: Optional[str] = None  # a database URL or a journal file path; None: in memory
    study_name: Optional[str] = None  # None: a new study with a generated name
    n_trials: int = 20  # finished trials the study should hold
    n_jobs: int = 2  # trials per batch handed to the launcher at once
    params: Optional[dict[str, str]] = None  # the search space, as overrides
    custom_search_space: Optional[str] = None  # dotted path of fn(cfg, trial) -> None


def open_storage(storage: str | None):
    """A URL names a database (Optuna's RDB storage); anything else is a journal file."""
    if storage is None or "://" in storage:
        return storage
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    path = Path(storage).expanduser().absolute()
    path.parent.mkdir(parents=True, exist_ok=True)
    return JournalStorage(JournalFileBackend(str(path)))


# ---------------------------------------------------------------------------------------------
# the sweeper
# ---------------------------------------------------------------------------------------------


class OptunaSweeper(Sweeper):
    def __init__(
        self,
        sampler: Any,
        direction: str,
        storage: Optional[str],
        study_name: Optional[str],
        n_trials: int,
        n_jobs: int,
        params: Optional[DictConfig],
        custom_search_space: Optional[str],
    ) -> None:
        if direction not in ("minimize", "maximize"):
            raise ValueError(f"hydra.sweeper.direction={direction}: minimize or maximize")
        self.sampler, self.direction = sampler, direction
        self.storage, self.study_name = storage, study_name
        self.n_trials, self.n_jobs = n_trials, max(1, n_jobs)
        self.params = dict(params or {})
        self.extend_space: Callable | None = (
            get_method(custom_search_space) if custom_search_space else None
        )

    def setup(
        self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig
    ) -> None:
        self.config = config
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config
        )

    def sweep(self, arguments: list[str]) -> None:
        import optuna

        space, fixed, listed = parse([f"{k}={v}" for k, v in self.params.items()] + arguments)
        sampler = self.sampler
        if callable(sampler) and not isinstance(sampler, optuna.samplers.BaseSampler):
            sampler = sampler(search_space=listed)  # the grid sampler takes the choices
        study = optuna.create_study(
            study_name=self.study_name,
            sampler=sampler,
            storage=open_storage(self.storage),
            direction=self.direction,
            load_if_exists=True,
        )
        log.info(
            f"Optuna study {study.study_name!r} ({self.storage or 'in memory'}), "
            f"{type(sampler).__name__}, {self.direction}"
        )
        failures = 0
        while (
            (todo := self.n_trials - counted(study)) > 0
            and failures < self.n_trials
            and not exhausted(study)
        ):
            trials = [study.ask(fixed_distributions=space) for _ in range(min(todo, self.n_jobs))]
            for trial in trials:
                trial.set_user_attr(WORKER, worker_id())
                if self.extend_space is not None:
                    self.extend_space(self.config, trial)
            batch = [
                [*as_overrides(trial.params, fixed), f"hydra.sweep.subdir={trial.number}"]
                for trial in trials
            ]
            for trial, job in zip(trials, self.launcher.launch(batch, trials[0].number)):
                failures += not tell(study, trial, job)
        if failures >= self.n_trials:
            raise RuntimeError(f"Optuna sweep stopped: {failures} trials failed")
        best = study.best_trial
        log.info(f"Best trial {best.number}: value {best.value}, params {best.params}")
        OmegaConf.save(
            OmegaConf.create(
                {
                    "name": "optuna",
                    "study_name": study.study_name,
                    "best_params": best.params,
                    "best_value": best.value,
                    "best_trial": best.number,
                }
            ),
            Path(str(self.config.hydra.sweep.dir)) / "optimization_results.yaml",
        )


def worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def counted(study) -> int:
    """Trials toward ``n_trials``: complete or pruned ones, and those running in a live worker.

    A trial left running by a sweep process that was killed on this host is told failed first
    (its worker's pid is gone), so a restarted sweep runs it again instead of waiting for it.
    Running trials of other hosts count as live: stopping early is for their workers to see.
    """
    from optuna.trial import TrialState

    host = socket.gethostname()
    live = 0
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        worker_host, _, pid = trial.user_attrs.get(WORKER, ":").partition(":")
        if worker_host == host and pid and not pid_alive(int(pid)):
            log.info(f"trial {trial.number} was left running by a killed sweep; failing it")
            study.tell(trial.number, state=TrialState.FAIL)
        else:
            live += 1
    done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))
    return len(done) + live


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def exhausted(study) -> bool:
    """A grid sampler has run every point of its grid (other samplers never are)."""
    is_exhausted = getattr(study.sampler, "is_exhausted", None)
    return bool(is_exhausted and is_exhausted(study))


def tell_study(study, trial, *args, **kwargs) -> None:
    """``study.tell``, where the grid sampler's stop after its last point is the end of the grid:
    Optuna's ``GridSampler`` calls ``Study.stop`` in ``after_trial``, which ask-and-tell cannot
    take (a ``RuntimeError``, optuna#4121; Hydra's Optuna sweeper catches it the same way); the
    trial's result is stored before (``Study.tell`` writes it in a ``finally``)."""
    try:
        study.tell(trial, *args, **kwargs)
    except RuntimeError as error:
        if "Study.stop" not in str(error) or not exhausted(study):
            raise


def tell(study, trial, job) -> bool:
    """Tell Optuna the job's objective, or that it failed (the sweep goes on); True if told a
    value. The run's directory is kept as a user attribute of the trial."""
    from optuna.trial import TrialState

    try:
        result = job.return_value  # re-raises the job's exception
        value = float(result)
    except Exception as error:  # noqa: BLE001 - any failure of one trial fails only that trial
        log.error(f"trial {trial.number} failed: {type(error).__name__}: {error}")
        tell_study(study, trial, state=TrialState.FAIL)
        return False
    trial.set_user_attr("run_dir", str(result.run_dir))
    tell_study(study, trial, value)
    log.info(f"trial {trial.number}: {value:.6g} {trial.params}")
    return True
