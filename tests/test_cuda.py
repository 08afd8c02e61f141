"""plait's GPU paths: an NCCL process group, one GPU per local rank, bf16 autocast on CUDA, and the
refusal of more processes than GPUs.

The ``cuda`` tests run where GPUs are (``python -m pytest -m cuda``) and are skipped with the
reason elsewhere (see ``conftest.py``).
"""

import json

import inhouse
import pytest
import torch

from plait.plan import make_plan
from plait.testing import run_losses

# Clipping off, so a gradient off by a constant factor would show in the losses.
STEPS = ["train.steps=8", "train.batch_size=8", "train.grad_clip=0", "device=cuda"]


@pytest.mark.slow
@pytest.mark.cuda
def test_one_gpu_runs_nccl_and_bf16_tracks_fp32(tmp_path):
    fp32 = run_losses(
        tmp_path / "fp32",
        [*STEPS, "launcher.nproc_per_node=1"],
        plugins=[inhouse.RecordPlacement(tmp_path)],
    )
    assert inhouse.read_placements(tmp_path) == [
        {"rank": 0, "local_rank": 0, "device": "cuda:0", "backend": "nccl", "world_size": 1}
    ]
    bf16 = run_losses(tmp_path / "bf16", [*STEPS, "launcher.nproc_per_node=1", "precision=bf16"])
    # bf16 keeps 8 mantissa bits: per-step losses within 2% of fp32, and not equal (autocast ran)
    assert bf16 == pytest.approx(fp32, rel=2e-2)
    assert bf16 != fp32
    assert fp32[-1] < fp32[0]


@pytest.mark.slow
@pytest.mark.cuda
def test_the_host_waits_for_the_gpu_only_at_the_guard_and_the_loss_read(tmp_path):
    """In a step the host may wait for the GPU where it must: the step guard's verdict (before
    the optimizer step) and the loss and norm read at the end. A wait anywhere else stops the
    launches that overlap the backward (a blocking copy after backward cost 3 ms of a 50 ms GPT-2
    step on an H200: docs/benchmarks.md)."""
    run_losses(
        tmp_path / "run",
        [*STEPS, "launcher.nproc_per_node=1", "precision=bf16", "train.log_every=100"],
        plugins=[inhouse.RecordDeviceWaits(tmp_path, first=3, last=6)],  # not the logged last
    )
    steps = [json.loads(line) for line in (tmp_path / "waits.jsonl").read_text().splitlines()]
    assert len(steps) == 4
    for waits in steps:
        assert [stack[-1] for stack in waits] == ["plait_check_step", "train_step", "train_step"]


@pytest.mark.slow
@pytest.mark.cuda(gpus=2)
def test_each_rank_takes_the_gpu_of_its_local_rank_and_matches_one_gpu(tmp_path):
    one = run_losses(
        tmp_path / "one", [*STEPS, "launcher.nproc_per_node=1", "train.grad_accum_steps=2"]
    )
    two = run_losses(
        tmp_path / "two",
        [*STEPS, "launcher.nproc_per_node=2"],
        plugins=[inhouse.RecordPlacement(tmp_path)],
    )
    assert inhouse.read_placements(tmp_path) == [
        {"rank": r, "local_rank": r, "device": f"cuda:{r}", "backend": "nccl", "world_size": 2}
        for r in range(2)
    ]
    # fp32 (TF32 off, torch's default for matmuls): only the summation order differs
    assert two == pytest.approx(one, rel=1e-4)


@pytest.mark.cuda
def test_more_processes_than_gpus_is_refused_before_launch():
    gpus = torch.cuda.device_count()
    for device in ("cuda", "auto"):
        problems = make_plan([f"device={device}", f"launcher.nproc_per_node={gpus + 1}"]).problems
        assert (
            f"device={device} gives each process the GPU of its local rank, but this node has "
            f"{gpus} GPU(s) for {gpus + 1} processes" in "\n".join(problems)
        )


def test_a_one_gpu_host_refuses_two_processes_on_auto(monkeypatch):
    # No GPU here: torch's answers for a 1-GPU host stand in (the test above asks a real one).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert (
        "device=auto gives each process the GPU of its local rank, but this node has 1 GPU(s) "
        "for 2 processes (launcher.nproc_per_node=2): set launcher.nproc_per_node=1, or "
        "device=cpu" in make_plan(["launcher.nproc_per_node=2"]).problems
    )
    assert make_plan(["launcher.nproc_per_node=2", "device=cpu"]).problems == []
    # under torchrun the node's process count is torchrun's, not launcher.nproc_per_node
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert make_plan(["launcher.nproc_per_node=2"]).problems == []
