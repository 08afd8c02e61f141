"""Resharding: a checkpoint written at one layout resumes at another (dp size, ddp <-> ZeRO,
tp, pp), converted on resume through its layout-free DCP copy, and the next losses and samples
are those of the run that never stopped."""

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from plait.cli import main
from plait.testing import read_metrics, run_training

import inhouse

STEPS, SAVED = 8, 4
BASE = [f"train.steps={STEPS}", f"optimizer.decay_steps={STEPS}", "fault.keep_last=0",
        "precision=fp32"]
RUN = [*BASE, f"fault.checkpoint_every={SAVED}"]
DP2 = ["launcher.nproc_per_node=2"]


def losses(run_dir: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in read_metrics(run_dir)}


def samples(directory: Path, ranks: int) -> list[list[str]]:
    """Each recorded step's input rows of all ranks together (sorted: the global batch)."""
    per_rank = [sum(inhouse.recorded_steps(directory, r), []) for r in range(ranks)]
    return [sorted(sum(step, [])) for step in zip(*per_rank)]


def checkpoint(run_dir: Path) -> Path:
    return run_dir / "checkpoints" / f"step_{SAVED:08d}"


@pytest.fixture(scope="module")
def origins(tmp_path_factory):
    """Two uninterrupted 8-step runs on 2 ranks, checkpointed at step 4: ``ddp`` (with every
    rank's input rows recorded) and ``zero1``."""
    root = tmp_path_factory.mktemp("reshard")
    runs = {}
    for strategy in ("ddp", "zero1"):
        run_dir = root / strategy
        plugins = [inhouse.RecordBatches(root / "rows_ddp")] if strategy == "ddp" else []
        run_training(run_dir, [*RUN, *DP2, f"strategy={strategy}"], plugins)
        runs[strategy] = run_dir
    return root, runs


def resume(root: Path, origin: Path, name: str, overrides: list[str], plugins=()) -> Path:
    run_dir = root / name
    run_training(run_dir, [*RUN, *overrides, f"resume={checkpoint(origin)}"], plugins)
    return run_dir


def assert_next_losses_match(origin: Path, resumed: Path) -> None:
    got, want = losses(resumed), losses(origin)
    assert sorted(got) == list(range(SAVED + 1, STEPS + 1))
    assert [got[s] for s in sorted(got)] == pytest.approx(
        [want[s] for s in sorted(got)], abs=1e-5)


@pytest.mark.slow
def test_ddp_on_two_ranks_resumes_on_one_rank_with_the_same_samples(origins, capfd):
    root, runs = origins
    resumed = resume(root, runs["ddp"], "ddp_dp1", ["launcher.nproc_per_node=1"],
                     [inhouse.RecordBatches(root / "rows_dp1")])
    assert "plait: converting checkpoint" in capfd.readouterr().out
    assert_next_losses_match(runs["ddp"], resumed)
    assert samples(root / "rows_dp1", 1) == samples(root / "rows_ddp", 2)[SAVED:]


@pytest.mark.slow
@pytest.mark.parametrize("name, overrides", [
    ("zero2", ["strategy=zero2", *DP2]),
    ("tp2", ["parallel.tp=2", *DP2]),
])
def test_ddp_checkpoint_resumes_under_another_strategy_or_tp(origins, name, overrides):
    root, runs = origins
    assert_next_losses_match(runs["ddp"], resume(root, runs["ddp"], name, overrides))


@pytest.mark.slow
def test_zero1_checkpoint_resumes_as_a_ddp_pipeline(origins):
    root, runs = origins
    resumed = resume(root, runs["zero1"], "zero1_to_pp2",
                     ["strategy=ddp", "parallel.pp=2", "pipeline.microbatches=2", *DP2])
    assert_next_losses_match(runs["zero1"], resumed)


@pytest.mark.slow
def test_async_save_killed_during_the_background_write_leaves_the_previous_checkpoint(
        origins, capfd):
    """Checkpoints every 2 steps written in the background; rank 0 is SIGKILLed after step 5
    while step 4's write is still running: the restart resumes from step 2 (step 4 was never
    published) and the run ends with the uninterrupted losses."""
    root, runs = origins
    run_dir = root / "async"
    run_training(run_dir, [*BASE, "fault.checkpoint_every=2", "fault.async_save=true", *DP2,
                           "launcher.max_restarts=1"], [inhouse.HoldWriteThenKill(4, 5)])
    out = capfd.readouterr().out
    assert f"plait: resumed from {run_dir / 'checkpoints' / 'step_00000002'} at step 2" in out
    assert [m["restarts"] for m in read_metrics(run_dir)][-1] == 1
    assert losses(run_dir) == pytest.approx(losses(runs["ddp"]), abs=1e-6)
    checkpoints = run_dir / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == [
        "latest", *(f"step_{s:08d}" for s in (2, 4, 6, 8))]
    assert not (checkpoints / "step_00000008" / "model_pp0_tp0.pt").exists()  # DCP only


def fake_checkpoint(tmp_path: Path, layout: dict, model: dict | None = None) -> Path:
    """A complete checkpoint directory as ``layout`` would have written it (no worker runs);
    with ``model``, its layout-free copy holds those tensors."""
    path = tmp_path / "old" / "checkpoints" / f"step_{SAVED:08d}"
    path.mkdir(parents=True)
    (path / "layout.json").write_text(json.dumps(layout))
    if model is not None:
        dcp.save({"model": model}, checkpoint_id=path / "layout_free", no_dist=True)
    (path / "complete.json").write_text(json.dumps({"files": {}}))
    return path


def refusal(tmp_path: Path, capsys, overrides: list[str]) -> str:
    assert main(["train", f"run.root={tmp_path}", "run.name=new", *overrides]) == 2
    assert not (tmp_path / "new").exists()
    return capsys.readouterr().err


DDP_DP2 = {"strategy": "ddp", "dp": 2, "tp": 1, "pp": 1, "engine_files": True,
           "layout_free": True}


def test_what_cannot_be_resharded_is_refused_before_launch(tmp_path, capsys):
    no_copy = fake_checkpoint(tmp_path, {**DDP_DP2, "strategy": "local_sgd",
                                         "layout_free": False})
    err = refusal(tmp_path, capsys, [f"resume={no_copy}", "launcher.nproc_per_node=1"])
    assert (f"resume: checkpoint {no_copy} was written with strategy=local_sgd parallel.dp=2 "
            "parallel.tp=1 parallel.pp=1, which saves no layout-free copy, so it cannot be "
            "converted to strategy=ddp parallel.dp=1 parallel.tp=1 parallel.pp=1: resume with "
            "strategy=local_sgd parallel.dp=2") in err
    assert "Traceback" not in err


def test_a_layout_free_checkpoint_of_another_model_is_refused(tmp_path, capsys):
    other = fake_checkpoint(tmp_path, DDP_DP2, model={"embed.tok.weight": torch.zeros(3, 4)})
    err = refusal(tmp_path, capsys, [f"resume={other}", "launcher.nproc_per_node=1"])
    assert (f"resume: checkpoint {other} holds another model (embed.tok.weight: (3, 4) in the "
            "checkpoint, (256, 64) in the model; ") in err
    assert "parameters missing, e.g. ['blocks.0." in err


def test_async_save_with_a_strategy_that_cannot_write_it_is_refused(tmp_path, capsys):
    err = refusal(tmp_path, capsys, ["fault.async_save=true", "strategy=local_sgd"])
    assert ("fault.async_save=true: strategy=local_sgd cannot write the layout-free (DCP) "
            "state") in err
