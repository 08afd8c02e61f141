"""Search that really runs: plait's Optuna sweeper (TPE on a persistent journal study, killed and
restarted) and its PBT sweeper (a bad member replaced by a perturbed copy of a good one), each
trial a real plait run through Hydra's launcher."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml
from inhouse import OptimizerSettingsAfterLoad
from omegaconf import OmegaConf

from plait import api
from plait.cli import main
from plait.plugins.tune.pbt import Member, PBTSweeper
from plait.plugins.tune.search_space import parse
from plait.testing import TEST_OVERRIDES, read_metrics, read_wandb_run

SMALL = [o for o in TEST_OVERRIDES if not o.startswith("train.steps=")]
SMALL += [
    "train.seq_len=16",
    "train.batch_size=4",
    "optimizer.warmup_steps=1",
    "launcher.nproc_per_node=1",
]


def optuna_sweep(tmp_path) -> list[str]:
    return [
        "train",
        "-m",
        "hydra/sweeper=optuna",
        "hydra.sweeper.n_trials=4",
        "hydra.sweeper.n_jobs=1",
        f"hydra.sweeper.storage={tmp_path}/lr.journal",
        "hydra.sweeper.study_name=lr",
        "hydra.sweeper.sampler.seed=0",
        "hydra.sweeper.sampler.n_startup_trials=2",
        "optimizer.lr=tag(log,interval(1e-4,1e-2))",
        *SMALL,
        "train.steps=2",
        "optimizer.decay_steps=2",
        f"run.root={tmp_path}",
        "run.name=lr",
    ]


def study_trials(tmp_path):
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    if not (tmp_path / "lr.journal").exists():
        return []
    storage = JournalStorage(JournalFileBackend(str(tmp_path / "lr.journal")))
    return optuna.load_study(study_name="lr", storage=storage).get_trials()


@pytest.mark.slow
def test_a_grid_sweep_runs_each_point_once_and_ends_with_the_grid(tmp_path):
    """Optuna's grid sampler stops the study after its last point, which ask-and-tell cannot
    take (optuna#4121): the sweep ends there, n_trials above the grid's size, with every point
    run once and the best one written."""
    sweep = [
        "train",
        "-m",
        "hydra/sweeper=optuna",
        "hydra/sweeper/sampler=grid",
        "hydra.sweeper.n_trials=5",
        "optimizer.lr=choice(1e-3,3e-3)",
        *SMALL,
        "train.steps=2",
        "optimizer.decay_steps=2",
        f"run.root={tmp_path}",
        "run.name=grid",
    ]
    assert main(sweep) == 0
    results = OmegaConf.load(tmp_path / "grid" / "optimization_results.yaml")
    assert results.best_params["optimizer.lr"] in (1e-3, 3e-3)
    trials = sorted(p.name for p in (tmp_path / "grid").iterdir() if p.name.isdigit())
    assert trials == ["0", "1"]


@pytest.mark.slow
def test_optuna_sweep_killed_after_two_trials_continues_to_four(tmp_path):
    from optuna.trial import TrialState

    # the sweep, killed (SIGKILL, sweeper and workers) once its study holds 2 finished trials
    sweep = subprocess.Popen(
        [sys.executable, "-m", "plait", *optuna_sweep(tmp_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 300
    while sum(t.state == TrialState.COMPLETE for t in study_trials(tmp_path)) < 2:
        assert sweep.poll() is None and time.monotonic() < deadline, "the sweep ended early"
        time.sleep(0.5)
    os.killpg(sweep.pid, signal.SIGKILL)
    sweep.wait()
    # started again with the same study: it runs only what is missing
    assert main(optuna_sweep(tmp_path)) == 0
    trials = study_trials(tmp_path)
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    assert len(complete) == 4
    # a trial the killed sweep had started is told failed, not waited for
    assert all(t.state in (TrialState.COMPLETE, TrialState.FAIL) for t in trials)
    # each finished trial is a plait run whose objective is its final validation loss
    for trial in complete:
        run_dir = tmp_path / "lr" / str(trial.number)
        assert trial.user_attrs["run_dir"] == str(run_dir)
        last = read_metrics(run_dir)[-1]
        assert last["step"] == 2 and trial.value == pytest.approx(last["eval/loss"])
        assert 1e-4 <= trial.params["optimizer.lr"] <= 1e-2
    best = yaml.safe_load((tmp_path / "lr" / "optimization_results.yaml").read_text())
    assert best["best_value"] == min(t.value for t in complete)


ROUND = 3  # steps per PBT round


@pytest.fixture(scope="module")
def pbt(tmp_path_factory):
    """Population 4, two rounds of 3 steps; member 0's lr (1e-6) is far too small."""
    root = tmp_path_factory.mktemp("pbt")
    api.multirun(
        [
            "hydra/sweeper=pbt",
            "hydra.sweeper.population=4",
            "hydra.sweeper.rounds=2",
            f"hydra.sweeper.steps_per_round={ROUND}",
            "hydra.sweeper.resample_probability=0",
            "hydra.sweeper.seed=0",
            "optimizer.lr=1e-6,3e-3,6e-3,1e-2",
            "optimizer.weight_decay=0.1,0.11,0.12,0.13",
            *SMALL,
            "tracker=wandb",
            f"optimizer.decay_steps={2 * ROUND}",
            f"run.root={root}",
            "run.name=pbt",
        ],
        plugins=[OptimizerSettingsAfterLoad()],
    )
    lineage = [json.loads(line) for line in (root / "pbt" / "pbt_lineage.jsonl").open()]
    return root / "pbt", lineage


@pytest.mark.slow
def test_pbt_replaces_the_bad_member_by_a_perturbed_copy_of_the_best(pbt):
    sweep, lineage = pbt
    # each member's score in the lineage is its run's validation loss at the end of the round
    for member in lineage:
        [end] = [
            m
            for m in read_metrics(sweep / member["name"])
            if m["step"] == (member["round"] + 1) * ROUND
        ]
        assert member["score"] == end["eval/loss"], member
    first = {m["name"]: m for m in lineage if m["round"] == 0}
    second = {m["name"]: m for m in lineage if m["round"] == 1}
    assert first["m0"]["params"]["optimizer.lr"] == 1e-6
    assert first["m0"]["score"] == max(m["score"] for m in first.values())  # clearly the worst
    # exploit: m0 is gone; m4, a copy of the best member, took its place
    best = min(first.values(), key=lambda m: m["score"])
    assert set(second) == {"m1", "m2", "m3", "m4"}
    child = second["m4"]
    assert child["parent"] == best["name"]
    # explore: each hyperparameter is the parent's times 0.8 or 1.2
    for key, value in child["params"].items():
        assert value / best["params"][key] in (pytest.approx(0.8), pytest.approx(1.2)), key
    # its round-2 loss starts where the parent's weights and data stood: the parent's own
    # next loss (computed before either steps with its own lr) ...
    mine, parents = read_metrics(sweep / "m4"), read_metrics(sweep / best["name"])
    assert [m["step"] for m in mine] == [ROUND + 1, ROUND + 2, ROUND + 3]
    assert mine[0]["loss"] == pytest.approx(parents[ROUND]["loss"], rel=1e-6)
    # ... and its optimizer steps with the perturbed hyperparameters, not the checkpoint's
    # (the same point of the cosine schedule from its own peak lr down to min_lr)
    min_lr = OmegaConf.load(sweep / "m4" / "config.yaml").optimizer.min_lr
    progress = (parents[ROUND]["lr"] - min_lr) / (best["params"]["optimizer.lr"] - min_lr)
    assert mine[0]["lr"] == pytest.approx(
        min_lr + (child["params"]["optimizer.lr"] - min_lr) * progress, rel=1e-6
    )
    [group] = json.loads((sweep / "m4" / "optimizer_after_load.json").read_text())[:1]
    assert group["weight_decay"] == pytest.approx(child["params"]["optimizer.weight_decay"])
    # the child is a new W&B run of the sweep naming its parent; the others continue theirs
    run, parent_run = read_wandb_run(sweep / "m4"), read_wandb_run(sweep / best["name"])
    assert run["id"] != parent_run["id"] and run["group"] == "pbt"
    assert run["config"]["parent"]["run_name"] == f"pbt/{best['name']}"
    assert run["config"]["parent"]["tracker_run_id"] == parent_run["id"]
    ids = {d.name.rsplit("-", 1)[1] for d in (sweep / "m1" / "wandb").glob("offline-run-*")}
    assert len(list((sweep / "m1" / "wandb").glob("offline-run-*"))) == 2 and len(ids) == 1


# ---------------------------------------------------------------------------------------------
# PBT's exploit and explore step, no runs
# ---------------------------------------------------------------------------------------------

LR_SPACE = "optimizer.lr=tag(log,interval(1e-4,1e-2))"


def exploit_and_explore(tmp_path, quantile: float, resample_probability: float):
    """One exploit-and-explore step of a population of 8 whose member ``i`` scored ``i`` (m0
    best) with lr ``1e-3 · (i+1)/8``, each with a checkpoint to copy; the members that follow."""
    sweeper = PBTSweeper(
        population=8,
        rounds=2,
        steps_per_round=1,
        quantile=quantile,
        perturb_factors=[0.8, 1.2],
        resample_probability=resample_probability,
        direction="minimize",
        seed=0,
        params=None,
    )
    sweeper.space, _, _ = parse([LR_SPACE])
    sweeper.unbounded, sweeper.sweep_dir = set(), tmp_path
    members = []
    for i in range(8):
        checkpoint = tmp_path / f"m{i}" / "step_00000001"
        checkpoint.mkdir(parents=True, exist_ok=True)
        (checkpoint / "complete.json").write_text("{}")
        members.append(
            Member(
                f"m{i}",
                {"optimizer.lr": 1e-3 * (i + 1) / 8},
                score=float(i),
                checkpoint=str(checkpoint),
            )
        )
    following, _ = sweeper.exploit_and_explore(members, born=8)
    return members, following


def test_pbt_quantile_is_the_share_replaced_by_copies_of_the_best(tmp_path):
    for quantile, replaced in ((0.25, 2), (0.5, 4)):
        members, following = exploit_and_explore(tmp_path / str(quantile), quantile, 0.0)
        names = [m.name for m in following]
        worst = [m.name for m in members[-replaced:]]
        assert [n for n in names if n.startswith("m") and int(n[1:]) < 8] == [
            m.name for m in members[:-replaced]
        ], quantile
        children = [m for m in following if int(m.name[1:]) >= 8]
        assert len(children) == replaced and not set(worst) & set(names), quantile
        best = {m.name for m in members[:replaced]}
        assert {c.parent for c in children} <= best, quantile


def test_pbt_resample_probability_draws_afresh_instead_of_perturbing(tmp_path):
    members, following = exploit_and_explore(tmp_path / "perturb", 0.5, 0.0)
    by_name = {m.name: m for m in members}
    for child in following[-4:]:
        ratio = child.params["optimizer.lr"] / by_name[child.parent].params["optimizer.lr"]
        assert ratio == pytest.approx(0.8) or ratio == pytest.approx(1.2), ratio
    members, following = exploit_and_explore(tmp_path / "resample", 0.5, 1.0)
    by_name = {m.name: m for m in members}
    for child in following[-4:]:
        value = child.params["optimizer.lr"]
        ratio = value / by_name[child.parent].params["optimizer.lr"]
        assert ratio != pytest.approx(0.8) and ratio != pytest.approx(1.2), ratio
        assert 1e-4 <= value <= 1e-2  # drawn from the search space
