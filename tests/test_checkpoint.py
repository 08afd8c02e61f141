"""Checkpoints: a crashed run keeps its last good checkpoint, resume continues exactly."""

import json
from pathlib import Path

import inhouse
import pytest
import torch
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from plait.cli import main
from plait.plugins import checkpoint
from plait.plugins.checkpoint import directory
from plait.testing import compose, read_metrics, run_losses, run_training
from plait.types import TrainState

RUN = [
    "train.steps=8",
    "optimizer.decay_steps=8",
    "checkpoint.every=3",
    "launcher.nproc_per_node=2",
]


def model_state(run_dir: Path, step: int) -> dict:
    path = run_dir / "checkpoints" / f"step_{step:08d}" / "model_pp0_tp0.pt"
    return torch.load(path, weights_only=True)["model"]


@pytest.mark.slow
def test_crash_keeps_last_checkpoint_and_resume_matches_uninterrupted_run(tmp_path):
    straight = run_losses(tmp_path / "straight", RUN)

    crashed = tmp_path / "crashed"
    with pytest.raises(ChildFailedError):
        run_training(crashed, RUN, plugins=[inhouse.CrashAtStep(5)])
    ckpts = crashed / "checkpoints"
    assert (ckpts / "latest").read_text() == "step_00000003"
    assert json.loads((ckpts / "step_00000003" / "trainer_state.json").read_text())["step"] == 3

    run_training(crashed, [*RUN, "resume=latest"])
    steps = read_metrics(crashed)
    resumed = {m["step"]: m["loss"] for m in steps}  # steps 4, 5 logged twice: last wins
    assert [resumed[s] for s in range(1, 9)] == pytest.approx(straight, rel=1e-6)
    # the model after resuming is the same bytes as after the uninterrupted run
    final_a, final_b = model_state(tmp_path / "straight", 8), model_state(crashed, 8)
    assert all(torch.equal(final_a[k], final_b[k]) for k in final_a)


def test_fresh_run_into_a_run_with_checkpoints_is_refused_and_nothing_changes(tmp_path, capsys):
    run_dir = tmp_path / "r"
    (run_dir / "checkpoints" / "step_00000004").mkdir(parents=True)
    (run_dir / "checkpoints" / "step_00000004" / "complete.json").write_text('{"files": {}}')
    (run_dir / "checkpoints" / "latest").write_text("step_00000004")
    (run_dir / "config.yaml").write_text("precious")
    assert main(["train", f"run.root={tmp_path}", "run.name=r", "resume=null"]) == 2
    assert (
        "already holds checkpoints (latest: step_00000004) and resume=null starts fresh: "
        "continue it with resume=auto"
    ) in capsys.readouterr().err
    assert (run_dir / "config.yaml").read_text() == "precious"


class FailingEngine:
    def save_state(self, directory):
        (directory / "half_written.pt").write_bytes(b"xx")
        raise OSError("disk full")


def test_a_failed_write_leaves_latest_on_the_previous_checkpoint(tmp_path):
    cfg = compose([f"run.root={tmp_path}", "run.name=r", "checkpoint.every=2"])
    root = tmp_path / "r" / "checkpoints"
    (root / "step_00000002").mkdir(parents=True)
    (root / "step_00000002" / "complete.json").write_text('{"files": {}}')
    (root / "latest").write_text("step_00000002")
    with pytest.raises(OSError, match="disk full"):
        checkpoint.plait_save_checkpoint(
            cfg=cfg,
            engine=FailingEngine(),
            state=TrainState(step=4),
            topology=inhouse.Rank0(),
            final=False,
            hook=inhouse.NoCapabilities,
        )
    assert (root / "latest").read_text() == "step_00000002"
    assert not (root / "step_00000004").exists()
    assert directory.resolve_resume(cfg, "latest") == root / "step_00000002"


@pytest.mark.slow
def test_export_loads_into_the_plain_model_with_the_same_eval_loss(tmp_path):
    run_dir = run_training(
        tmp_path / "r",
        [
            "train.steps=3",
            "launcher.nproc_per_node=2",
            "train.eval_every=3",
            "train.eval_batches=2",
        ],
    )
    assert main(["export", str(run_dir), f"out={tmp_path / 'full.pt'}"]) == 0
    import numpy as np

    from plait.plugins.data import TokenWindows, load_split, token_file
    from plait.plugins.models.gpt import GPT

    cfg = compose([f"run.root={tmp_path}", "run.name=other", "train.seq_len=32"])
    model = GPT(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=64)
    model.load_state_dict(torch.load(tmp_path / "full.pt", weights_only=True))
    path, _ = token_file(cfg, 0, "val")
    val = TokenWindows(load_split(np.memmap(path, dtype=np.uint16, mode="r"), 0.01, "val"), 32)
    micro = 4  # batch_size 8 over dp 2
    with torch.no_grad():
        losses = []
        for k in range(2):
            for rank in range(2):
                x, y = val.batch(list(range((k * 2 + rank) * micro, (k * 2 + rank + 1) * micro)))
                losses.append(
                    torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()
                )
    logged = read_metrics(run_dir)[-1]["eval/loss"]
    assert sum(losses) / len(losses) == pytest.approx(logged, rel=1e-5)


class StateFileEngine:
    """Writes and reads one file, the way an engine's own files are written."""

    def save_state(self, directory):
        (directory / "model.pt").write_bytes(b"weights")

    def load_state(self, directory):
        assert (directory / "model.pt").read_bytes() == b"weights"


def test_a_checkpoint_missing_a_ranks_random_state_is_refused_not_resumed_around(tmp_path):
    """Written at this layout, a checkpoint holds every rank's ``rng_rank<r>.pt``: a resume
    without it could not draw the same dropout masks, so it is an error naming the file, never a
    silent fresh random state. The random state saved is the one a resume restores."""
    cfg = compose(
        [
            f"run.root={tmp_path}",
            "run.name=r",
            "checkpoint.every=2",
            "launcher.nproc_per_node=1",
        ]
    )
    torch.manual_seed(7)
    checkpoint.plait_save_checkpoint(
        cfg=cfg,
        engine=StateFileEngine(),
        state=TrainState(step=2),
        topology=inhouse.Rank0(),
        final=False,
        hook=inhouse.NoCapabilities,
    )
    after_save = torch.rand(3)
    torch.manual_seed(99)
    resumed = checkpoint.plait_load_checkpoint(
        cfg=cfg, engine=StateFileEngine(), topology=inhouse.Rank0(), hook=inhouse.NoCapabilities
    )
    assert resumed.step == 2 and torch.equal(torch.rand(3), after_save)

    saved = tmp_path / "r" / "checkpoints" / "step_00000002"
    (saved / "rng_rank0.pt").unlink()
    files = json.loads((saved / "complete.json").read_text())
    del files["files"]["rng_rank0.pt"]  # complete by its own record: only the RNG file is gone
    (saved / "complete.json").write_text(json.dumps(files))
    with pytest.raises(FileNotFoundError, match="has no rng_rank0.pt: rank 0's random state"):
        checkpoint.plait_load_checkpoint(
            cfg=cfg, engine=StateFileEngine(), topology=inhouse.Rank0(), hook=inhouse.NoCapabilities
        )
