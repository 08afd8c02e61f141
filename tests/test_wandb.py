"""The W&B tracker: one offline run per job, read back from its run file."""

import json

import pytest

from plait.testing import read_metrics, read_wandb_run, run_training

pytestmark = pytest.mark.slow


def test_one_offline_run_with_config_metrics_and_rank_min_max(tmp_path):
    run_dir = run_training(
        tmp_path / "r",
        [
            "tracker=wandb",
            "tracker.project=plait-test",
            "train.steps=4",
            "launcher.nproc_per_node=2",
            "checkpoint.every=2",
            "train.peak_flops=1e12",
        ],
    )  # a CPU has no known peak
    assert len(list(run_dir.glob("wandb/offline-run-*"))) == 1  # one run per job, not per rank
    run = read_wandb_run(run_dir)
    cfg = run["config"]
    assert cfg["strategy"]["name"] == "ddp" and cfg["train"]["steps"] == 4
    assert cfg["run"]["dir"] == str(run_dir) and cfg["tracker"]["project"] == "plait-test"

    history = run["history"]
    assert [h["_step"] for h in history] == [1, 2, 3, 4]
    expected = read_metrics(run_dir)
    for logged, local in zip(history, expected):
        assert logged["loss"] == pytest.approx(local["loss"])
        for key in (
            "lr",
            "grad_norm",
            "tokens_per_s",
            "mfu",
            "step_time_s/min",
            "step_time_s/max",
            "peak_memory_bytes/min",
            "peak_memory_bytes/max",
        ):
            assert key in logged
        assert logged["step_time_s/min"] <= logged["step_time_s/max"]
        assert logged["mfu"] == pytest.approx(local["mfu"])

    state = json.loads(
        (run_dir / "checkpoints" / "step_00000004" / "trainer_state.json").read_text()
    )
    assert state["tracker_run_id"] == run["id"]


def test_resumed_job_continues_the_same_wandb_run(tmp_path):
    common = [
        "tracker=wandb",
        "launcher.nproc_per_node=1",
        "checkpoint.every=2",
        "optimizer.decay_steps=4",
    ]
    run_dir = run_training(tmp_path / "r", [*common, "train.steps=2"])
    first = read_wandb_run(run_dir)["id"]
    run_training(tmp_path / "r", [*common, "train.steps=4", "resume=latest"])
    runs = sorted(run_dir.glob("wandb/offline-run-*"))
    assert len(runs) == 2 and all(p.name.endswith(first) for p in runs)
    resumed = read_wandb_run(run_dir)
    assert resumed["id"] == first
    assert [h["_step"] for h in resumed["history"]] == [3, 4]
