"""``plait train -m``: Hydra's own multirun, one plait run per job, objectives back to the
sweeper, W&B runs grouped by sweep; Hydra's other flags."""

from __future__ import annotations

import logging
import re

import pytest

from plait.cli import main
from plait.plan import default_run_name
from plait.testing import TEST_OVERRIDES, read_metrics, read_wandb_run

STEPS = ["train.steps=3", "optimizer.decay_steps=3"]


@pytest.mark.slow
def test_multirun_over_two_strategies(tmp_path, capsys):
    code = main(
        [
            "train",
            "-m",
            "strategy=ddp,zero2",
            *TEST_OVERRIDES,
            *STEPS,
            "tracker=wandb",
            "launcher.nproc_per_node=2",
            f"run.root={tmp_path}",
            "run.name=sweep",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out[-3000:]
    jobs = [tmp_path / "sweep" / str(n) for n in (0, 1)]
    # two runs, each in its job's directory beside Hydra's record of the job
    assert all((j / ".hydra" / "overrides.yaml").exists() for j in jobs)
    ddp, zero2 = ([m["loss"] for m in read_metrics(j)] for j in jobs)
    assert len(ddp) == 3 and zero2 == pytest.approx(ddp, rel=1e-5)
    # each job's objective (its final validation loss) went back to the sweeper
    reported = [float(x) for x in re.findall(r"objective ([0-9.]+)", out)]
    assert reported == pytest.approx([read_metrics(j)[-1]["eval/loss"] for j in jobs])
    # two W&B runs, one group: the sweep
    runs = [read_wandb_run(j) for j in jobs]
    assert [(r["name"], r["group"], r["job_type"]) for r in runs] == [
        ("sweep/0", "sweep", "trial"),
        ("sweep/1", "sweep", "trial"),
    ]
    assert runs[0]["id"] != runs[1]["id"]
    assert [r["config"]["strategy"]["name"] for r in runs] == ["ddp", "zero2"]


@pytest.fixture
def restore_logging():
    """Hydra's --info configures logging with handlers on this test's captured streams."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:], root.level = handlers, level


def test_hydra_flags_work_on_plait_train(capsys, caplog, restore_logging):
    assert main(["train", "--cfg", "job", "strategy=zero2", "parallel.tp=2"]) == 0
    printed = capsys.readouterr().out
    assert "name: zero2" in printed and "tp: 2" in printed and "hydra:" not in printed
    assert main(["train", "--cfg", "hydra", "-m", "hydra/sweeper=optuna"]) != 0  # one command
    capsys.readouterr()
    assert main(["train", "--info", "defaults", "hydra/sweeper=optuna"]) == 0
    assert "hydra/sweeper/optuna" in caplog.text  # Hydra logs the defaults list


@pytest.mark.parametrize(
    "overrides,message",
    [
        # a value of a swept setting, refused before the first job runs
        (
            ["parallel.tp=2", "launcher.nproc_per_node=2,3"],
            "world_size(3) is not divisible by tp(2) * pp(1)",
        ),
        # either end of a searched interval
        (
            [
                "hydra/sweeper=optuna",
                "optimizer.lr=tag(log,interval(1e-4,1e-2))",
                "optimizer.warmup_steps=int(interval(-2,4))",
            ],
            "optimizer.warmup_steps=-2 is out of range: set optimizer.warmup_steps >= 0",
        ),
        # a SLURM job's settings, before sbatch
        (
            ["launcher=slurm", "launcher.time=0", "launcher.gpus_per_node=-1"],
            "launcher.time=0 is out of range: set launcher.time >= 1 (minutes)",
        ),
        (
            ["launcher=slurm", "launcher.gpus_per_node=-1"],
            "launcher.gpus_per_node=-1 is out of range: set launcher.gpus_per_node >= 0",
        ),
        # the sweepers' own settings
        (
            ["hydra/sweeper=pbt", "hydra.sweeper.population=1", "optimizer.lr=1e-3,1e-2"],
            "hydra.sweeper: population >= 2",
        ),
    ],
    ids=["grid", "optuna-interval", "slurm-time", "slurm-gpus", "pbt"],
)
def test_a_bad_sweep_is_refused_before_any_job(overrides, message, tmp_path, capsys):
    code = main(["train", "-m", *overrides, f"run.root={tmp_path}", "run.name=s"])
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
    assert "Traceback" not in err and not any(tmp_path.iterdir())


def test_default_run_names_of_parallel_trials_differ():
    names = {default_run_name() for _ in range(20)}  # all within the same second
    assert len(names) == 20
