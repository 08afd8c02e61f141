"""DDP on 2 processes against 1 process on the same global batch, and mixed precision."""

import json
import re

import inhouse
import pytest

from plait.testing import read_metrics, run_losses

pytestmark = pytest.mark.slow

# fp32 on the CPU: the two runs differ only in the order gradients are summed (one process
# accumulates 2 micro-batches, DDP all-reduces 2 ranks), so losses agree to float32 rounding and
# so do the global gradient norms (observed: 2e-7 relative).
REL = 1e-5
STEPS = ["train.steps=12", "train.batch_size=8", "train.grad_clip=0.5"]
# AdamW divides each update by the gradient's own scale and clipping rescales it, so a gradient
# off by a constant factor keeps the losses: the grad norms (before clipping) tell.
NO_CLIP = ["train.steps=12", "train.batch_size=8", "train.grad_clip=0"]


def grad_norms(run_dir) -> list[float]:
    return [m["grad_norm"] for m in read_metrics(run_dir)]


def layout_that_ran(capfd) -> str:
    """The process layout rank 0's console reported for the run that just finished."""
    [layout] = re.findall(
        r"on (\d+ process\(es\) \(dp \d+ x tp \d+ x pp \d+)", capfd.readouterr().out
    )
    return layout


def test_ddp_on_two_processes_matches_one_process(tmp_path, capfd):
    one = run_losses(
        tmp_path / "one", [*NO_CLIP, "launcher.nproc_per_node=1", "train.grad_accum_steps=2"]
    )
    assert layout_that_ran(capfd) == "1 process(es) (dp 1 x tp 1 x pp 1"
    two = run_losses(tmp_path / "two", [*NO_CLIP, "launcher.nproc_per_node=2"])
    assert layout_that_ran(capfd) == "2 process(es) (dp 2 x tp 1 x pp 1"
    assert len(one) == len(two) == 12
    assert two == pytest.approx(one, rel=REL)
    assert grad_norms(tmp_path / "two") == pytest.approx(grad_norms(tmp_path / "one"), rel=REL)
    assert one[-1] < one[0]  # and it learns


def test_ddp_with_grad_accumulation_matches_one_process(tmp_path):
    one = run_losses(
        tmp_path / "one", [*STEPS, "launcher.nproc_per_node=1", "train.grad_accum_steps=4"]
    )
    two = run_losses(
        tmp_path / "two", [*STEPS, "launcher.nproc_per_node=2", "train.grad_accum_steps=2"]
    )
    assert two == pytest.approx(one, rel=REL)
    # the norms before clipping (0.5 clips every step)
    assert min(grad_norms(tmp_path / "one")) > 0.5
    assert grad_norms(tmp_path / "two") == pytest.approx(grad_norms(tmp_path / "one"), rel=REL)


@pytest.fixture(scope="module")
def fp32(tmp_path_factory):
    return run_losses(tmp_path_factory.mktemp("fp32") / "r", [*STEPS, "launcher.nproc_per_node=1"])


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains_close_to_fp32(tmp_path, precision, fp32):
    mixed = run_losses(
        tmp_path / precision, [*STEPS, "launcher.nproc_per_node=1", f"precision={precision}"]
    )
    # bf16 keeps 8 mantissa bits, fp16 10 (with a dynamic loss scaler): per-step losses stay
    # within 2% of fp32 on this short run, and differ from it (autocast really ran).
    assert mixed == pytest.approx(fp32, rel=2e-2)
    assert mixed != fp32


def test_fp16_loss_scaler_skips_the_steps_that_overflow(tmp_path):
    """torch's GradScaler, through loss spikes at steps 2 and 3 of 4 (``inhouse.
    OverflowAtSteps``): each overflow skips the step and halves the scale."""
    run = tmp_path / "fp16"
    run_losses(
        run,
        [
            *inhouse.OVERFLOW_RUN,
            "train.batch_size=8",
            "launcher.nproc_per_node=1",
            "precision=fp16",
        ],
        plugins=[inhouse.OverflowAtSteps(2, 3)],
    )
    inhouse.assert_steps_2_and_3_skipped(run, scales=[1, 0.5, 0.25, 0.25])


def test_compiled_model_trains_like_eager(tmp_path, fp32, monkeypatch):
    """``strategy.compile=true``: torch.compile (TorchDynamo, Inductor's CPU kernels) around the
    model; the same losses as eager within float32 rounding of fused kernels (REL). Inductor
    compiles its kernels in the worker itself (one thread: no pool of compile processes, each
    importing torch, on a 2-core machine)."""
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "1")
    run = tmp_path / "compiled"
    compiled = run_losses(
        run,
        [*STEPS, "launcher.nproc_per_node=1", "strategy.compile=true"],
        plugins=[inhouse.RecordCompiled()],
    )
    record = json.loads((run / "compiled_rank0.json").read_text())
    assert record["optimized_module"] and record["unique_graphs"] >= 1, record
    assert compiled == pytest.approx(fp32, rel=REL)
