"""``hydra/sweeper=pbt``: population-based training (Jaderberg et al. 2017) as a Hydra sweeper.

    plait train -m hydra/sweeper=pbt hydra.sweeper.population=8 hydra.sweeper.rounds=10 \\
        hydra.sweeper.steps_per_round=200 'optimizer.lr=tag(log,interval(1e-4,1e-2))' \\
        'optimizer.weight_decay=interval(0.0,0.2)'

The population trains in rounds of ``steps_per_round`` steps (``train.stop_at`` ends each round's
job while the LR schedule spans ``rounds * steps_per_round``). After a round every member is
ranked by its objective (``tune.objective``, the final validation loss by default):

- **exploit**: each member of the worst ``quantile`` is replaced by a copy of a random member of
  the best ``quantile``: a new run (its own directory and W&B run, naming its parent) that resumes
  from a copy of the parent's checkpoint (weights, optimizer state, data position);
- **explore**: the copy's hyperparameters are the parent's, each multiplied by one of
  ``perturb_factors`` (x0.8 / x1.2, kept inside an ``interval``; a ``choice`` moves to a
  neighbouring value), or with ``resample_probability`` drawn afresh from its search space.

Everyone else continues its own run (``resume=latest``). The initial population samples the
search space; a plain list with one value per member (``optimizer.lr=1e-4,1e-3,3e-3,1e-2``) gives
member ``i`` value ``i``; explore multiplies such values without bounds and resamples them
between the list's extremes. The hyperparameters take effect on resume: the optimizer keeps the
configured ones, not the checkpoint's (``plait.engine.hyperparameters``).

Lineage (round, member, parent, hyperparameters, objective, run directory) is appended to
``<sweep dir>/pbt_lineage.jsonl``; each child's W&B run carries its parent in config and notes.

**Why a Hydra sweeper, not Ray Tune's or Syne Tune's PBT.** Each round is one batch for the
configured Hydra launcher, so a population runs on SLURM through submitit (``launcher=slurm``)
exactly as it runs locally, every member is an ordinary plait run (own directory, checkpoints,
W&B run, multi-process workers), and the exploit step copies plait's own checkpoints. Ray Tune
would bring a Ray cluster (started inside the SLURM allocation), run every trial as a Ray actor
that must in turn start plait's multi-process workers, and checkpoint through Ray's own storage;
Syne Tune has no SLURM backend. Both would bypass Hydra's launchers, which is where plait users
choose where jobs run. What is left to write is small: ranking, copying a checkpoint directory,
perturbing overrides, the same ~150 lines either engine's scheduler holds.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from hydra.core.plugins import Plugins
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig

from plait.plugins.tune.search_space import as_overrides, parse

log = logging.getLogger(__name__)


@dataclass
class PBTSweeperConfig:
    _target_: str = "hydra_plugins.plait_tune.PBTSweeper"
    population: int = 4
    rounds: int = 4
    steps_per_round: int = 100  # K: train.stop_at advances by K each round
    quantile: float = 0.25  # the share of the population replaced after each round
    perturb_factors: list[float] = field(default_factory=lambda: [0.8, 1.2])
    resample_probability: float = 0.25
    direction: str = "minimize"  # or maximize
    seed: Optional[int] = None
    params: Optional[dict[str, str]] = None  # the search space, as overrides


@dataclass
class Member:
    """One slot of the population in one round: a plait run and where it resumes from."""

    name: str
    params: dict[str, Any]
    resume: Optional[str] = None  # None (round 0), "latest" (its own run) or a checkpoint copy
    parent: Optional[str] = None  # the member it was copied from
    score: Optional[float] = None
    run_dir: Optional[str] = None
    checkpoint: Optional[str] = None


class PBTSweeper(Sweeper):
    def __init__(
        self,
        population: int,
        rounds: int,
        steps_per_round: int,
        quantile: float,
        perturb_factors: list[float],
        resample_probability: float,
        direction: str,
        seed: Optional[int],
        params: Optional[DictConfig],
    ) -> None:
        if direction not in ("minimize", "maximize"):
            raise ValueError(f"hydra.sweeper.direction={direction}: minimize or maximize")
        if population < 2 or rounds < 1 or steps_per_round < 1 or not 0 < quantile <= 0.5:
            raise ValueError(
                "hydra.sweeper: population >= 2, rounds >= 1, steps_per_round >= 1 "
                "and 0 < quantile <= 0.5"
            )
        self.population, self.rounds, self.steps_per_round = population, rounds, steps_per_round
        self.replaced = max(1, round(quantile * population))
        self.perturb_factors = list(perturb_factors)
        self.resample_probability = resample_probability
        self.direction = direction
        self.rng = random.Random(seed)
        self.params = dict(params or {})

    def setup(
        self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig
    ) -> None:
        self.sweep_dir = Path(str(config.hydra.sweep.dir)).absolute()
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config
        )

    def sweep(self, arguments: list[str]) -> list[Member]:
        from optuna.distributions import FloatDistribution

        space, fixed, listed = parse([f"{k}={v}" for k, v in self.params.items()] + arguments)
        if not space:
            raise ValueError(
                "hydra/sweeper=pbt needs hyperparameters to search, e.g. "
                "'optimizer.lr=tag(log,interval(1e-4,1e-2))'"
            )
        for key in ("train.steps", "train.stop_at", "resume"):
            if key in fixed:
                raise ValueError(
                    f"{key} is set by hydra/sweeper=pbt (rounds * steps_per_round "
                    "steps, a checkpoint per round); leave it out"
                )
        self.space, self.unbounded = space, set()
        for key, values in listed.items():  # a list of floats: starting values, not choices
            if values and all(isinstance(v, float) for v in values):
                low, high = min(values), max(values)
                space[key] = FloatDistribution(low, high, log=low > 0)
                self.unbounded.add(key)
        members = [
            Member(
                f"m{i}",
                {
                    key: (
                        listed[key][i]
                        if len(listed.get(key, ())) == self.population
                        else sample(dist, self.rng)
                    )
                    for key, dist in space.items()
                },
            )
            for i in range(self.population)
        ]
        job_idx, born = 0, self.population
        for round_ in range(self.rounds):
            batch = [
                [
                    *as_overrides(m.params, fixed),
                    f"train.steps={self.rounds * self.steps_per_round}",
                    f"train.stop_at={(round_ + 1) * self.steps_per_round}",
                    f"hydra.sweep.subdir={m.name}",
                    *([f"resume={m.resume}"] if m.resume else []),
                ]
                for m in members
            ]
            for member, job in zip(members, self.launcher.launch(batch, job_idx)):
                record(member, job, self.direction)
            job_idx += len(batch)
            self.write_lineage(round_, members)
            if round_ + 1 < self.rounds:
                members, born = self.exploit_and_explore(members, born)
        return members

    def exploit_and_explore(self, members: list[Member], born: int) -> tuple[list[Member], int]:
        sign = 1 if self.direction == "minimize" else -1
        ranked = sorted(members, key=lambda m: sign * m.score)
        best, worst = ranked[: self.replaced], ranked[-self.replaced :]
        if any(m.checkpoint is None for m in best):
            raise RuntimeError(
                "PBT: a member of the best quantile failed, so there is nothing "
                "to copy (see the errors above)"
            )
        following = []
        for member in members:
            if member not in worst:
                following.append(Member(member.name, member.params, "latest", member.parent))
                continue
            parent = self.rng.choice(best)
            child = Member(f"m{born}", self.explore(parent.params), parent=parent.name)
            child.resume = str(
                copy_checkpoint(
                    Path(parent.checkpoint),
                    self.sweep_dir / "pbt" / f"{child.name}-from-"
                    f"{parent.name}-{Path(parent.checkpoint).name}",
                )
            )
            log.info(
                f"PBT: {member.name} (objective {member.score:.6g}) is replaced by "
                f"{child.name}, a copy of {parent.name} ({parent.score:.6g}) with "
                f"{child.params}"
            )
            following.append(child)
            born += 1
        return following, born

    def explore(self, params: dict[str, Any]) -> dict[str, Any]:
        return {
            key: (
                sample(self.space[key], self.rng)
                if self.rng.random() < self.resample_probability
                else perturb(
                    value,
                    self.space[key],
                    self.perturb_factors,
                    self.rng,
                    bounded=key not in self.unbounded,
                )
            )
            for key, value in params.items()
        }

    def write_lineage(self, round_: int, members: list[Member]) -> None:
        self.sweep_dir.mkdir(parents=True, exist_ok=True)
        with open(self.sweep_dir / "pbt_lineage.jsonl", "a") as f:
            for member in members:
                f.write(json.dumps({"round": round_, **asdict(member)}) + "\n")


def record(member: Member, job, direction: str) -> None:
    """The member's objective, run directory and checkpoint; a failed run ranks last."""
    try:
        result = job.return_value  # re-raises the job's exception
        member.score = float(result)
    except Exception as error:  # noqa: BLE001 - a failed member is replaced, the rest go on
        log.error(f"PBT member {member.name} failed: {type(error).__name__}: {error}")
        member.score = math.inf if direction == "minimize" else -math.inf
        return
    member.run_dir = str(result.run_dir)
    member.checkpoint = str(result.checkpoint)


def sample(dist, rng: random.Random) -> Any:
    """A fresh value from an Optuna distribution."""
    from optuna.distributions import CategoricalDistribution, IntDistribution

    if isinstance(dist, CategoricalDistribution):
        return rng.choice(dist.choices)
    if dist.log:
        value = math.exp(rng.uniform(math.log(dist.low), math.log(dist.high)))
    else:
        value = rng.uniform(dist.low, dist.high)
    if dist.step:
        value = dist.low + round((value - dist.low) / dist.step) * dist.step
    return int(round(value)) if isinstance(dist, IntDistribution) else value


def perturb(value: Any, dist, factors: list[float], rng: random.Random, bounded: bool) -> Any:
    """x one of ``factors`` (kept within an interval's bounds); a choice moves one step."""
    from optuna.distributions import CategoricalDistribution, IntDistribution

    if isinstance(dist, CategoricalDistribution):
        index = dist.choices.index(value) + rng.choice((-1, 1))
        return dist.choices[min(max(index, 0), len(dist.choices) - 1)]
    moved = value * rng.choice(factors)
    if bounded:
        moved = min(max(moved, dist.low), dist.high)
    return int(round(moved)) if isinstance(dist, IntDistribution) else moved


def copy_checkpoint(source: Path, target: Path) -> Path:
    """Copy a complete checkpoint directory (hard links where the file system allows: a
    checkpoint is never modified once complete, and the copy survives its pruning)."""

    def link(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    shutil.copytree(source, target, copy_function=link, dirs_exist_ok=True)
    return target
