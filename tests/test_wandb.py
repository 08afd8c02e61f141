"""The W&B tracker: one offline run per job, read back from its run file."""

import json
import sys
import time
from pathlib import Path

import pytest

from plait import hookimpl
from plait.testing import read_metrics, read_wandb_run, run_training

pytestmark = pytest.mark.slow


def test_one_offline_run_with_config_metrics_and_rank_min_max(tmp_path):
    import_dirs = tmp_path / "import_dirs.json"
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
        [WandbImportDirs(import_dirs)],
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

    # the temporary directories W&B made in the tracking worker are gone with the worker
    made = json.loads(import_dirs.read_text())
    assert len(made) == 2 and not [d for d in made if Path(d).exists()]


class WandbImportDirs:
    """Writes to ``note`` where the W&B of the worker that imported it put the two temporary
    directories it makes when imported (read from W&B's own module attributes)."""

    def __init__(self, note: Path):
        self.note = str(note)

    @hookimpl
    def plait_on_run_end(self):
        if "wandb" not in sys.modules:
            return  # a rank that does not track
        from wandb.sdk.artifacts.artifact import Artifact
        from wandb.sdk.data_types._private import MEDIA_TMP

        Path(self.note).write_text(json.dumps([MEDIA_TMP.name, Artifact._TMP_DIR.name]))


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


class SlowWandbInit:
    """Holds ``wandb.init`` back ``seconds`` (a slow W&B service start) and writes the time it
    returned to ``note``: W&B itself runs as in any run, later."""

    def __init__(self, seconds: float, note: Path):
        self.seconds, self.note = seconds, str(note)

    @hookimpl(tryfirst=True)  # before the tracker starts W&B
    def plait_on_run_start(self):
        import wandb

        init = wandb.init

        def slow_init(**settings):
            time.sleep(self.seconds)
            run = init(**settings)
            Path(self.note).write_text(repr(time.time()))
            return run

        wandb.init = slow_init


def test_the_first_steps_do_not_wait_for_wandb_and_lose_nothing(tmp_path):
    """W&B starts on its own thread beside the first steps; what they log is held and logged, in
    order and at the times it was logged, once the run is up."""
    note = tmp_path / "init_returned"
    run_dir = run_training(
        tmp_path / "r",
        ["tracker=wandb", "train.steps=4", "optimizer.decay_steps=4", "launcher.nproc_per_node=1"],
        [SlowWandbInit(3.0, note)],
    )
    history = read_wandb_run(run_dir)["history"]
    assert [h["_step"] for h in history] == [1, 2, 3, 4]
    assert [h["loss"] for h in history] == pytest.approx([m["loss"] for m in read_metrics(run_dir)])
    times = [h["_timestamp"] for h in history]
    assert times == sorted(times)
    assert times[0] < float(note.read_text())  # step 1 was logged while W&B was starting
