"""3D parallelism: ZeRO-1 under pipeline stages (with and without tensor parallelism), and the
full pp=2 x tp=2 x dp=2 run on 8 processes, against one process.

Every run is the tiny GPT with 3 blocks: stages of 2 and 1 block, whose ZeRO-1 sub-groups
(``sizing.py``) would number 5 and 3 uncut, and DeepSpeed all-reduces each group's norm over the
stages (they deadlocked). A global batch of 8 sequences in 4 micro-batches (the single process
accumulates the same 4), fp32, gradient clipping on (the default max norm 1 is
below the early norms, so a wrong global norm over stages, shards or dp ranks changes the
losses). Only the summation order of the reductions differs: losses and pre-clipping grad norms
agree to a relative 2e-5 (the pipeline tests' tolerance).

ZeRO-1 under pipeline stages is DeepSpeed's own ZeRO-1 optimizer (``DeepSpeedZeroOptimizer``),
driven as DeepSpeed's pipeline engine drives it: the schedule runs the backward, then
``reduce_gradients(pipeline_parallel=True)`` averages each stage's gradients over its dp group
into the rank's partition, and the step clips by the norm over dp and every model-parallel rank.
"""

from __future__ import annotations

import os

import inhouse
import pytest
import torch

from plait.export import export
from plait.plugins.models.gpt import GPT
from plait.plugins.pipeline.split import build_stage_modules, split_stages
from plait.plugins.zero.estimate import zero_formula
from plait.testing import TEST_OVERRIDES, compose, read_metrics, run_training
from plait.types import PlanError

os.environ.setdefault("DS_ACCELERATOR", "cpu")

TOLERANCE = 2e-5
STEPS = 8  # past the warm-up, into the decay
STEPS_8 = 4  # the 8-process runs: few steps (2 cores)
COMMON = ["model.n_layer=3", "train.batch_size=8"]
PP2_DP2 = ["parallel.pp=2", "launcher.nproc_per_node=4", "pipeline.microbatches=2"]
PP2_TP2_DP2 = [
    "parallel.pp=2",
    "parallel.tp=2",
    "launcher.nproc_per_node=8",
    "pipeline.microbatches=2",
]


# ---------------------------------------------------------------------------------------------
# refused before launch (no processes)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "stage, reason",
    [
        ("zero0", "stage 0 partitions nothing; use strategy=ddp"),
        (
            "zero2",
            "DeepSpeed supports only ZeRO-1 under pipeline parallelism (its pipeline engine "
            "refuses ZeRO-2 and ZeRO-3: ZeRO-2 partitions gradients",
        ),
        (
            "zero3",
            "DeepSpeed supports only ZeRO-1 under pipeline parallelism (its pipeline engine "
            "refuses ZeRO-2 and ZeRO-3: ZeRO-3 partitions parameters",
        ),
    ],
)
def test_zero_stages_other_than_1_are_refused_with_pipeline_stages(stage, reason):
    with pytest.raises(PlanError) as refused:
        compose([*TEST_OVERRIDES, *COMMON, *PP2_DP2, f"strategy={stage}"])
    assert f"strategy={stage} with parallel.pp=2: " in str(refused.value)
    assert reason in str(refused.value)


def test_zero1_with_pipeline_stages_is_planned():
    cfg = compose([*TEST_OVERRIDES, *COMMON, *PP2_TP2_DP2, "strategy=zero1"])
    assert cfg.train.grad_accum_steps == 2


# ---------------------------------------------------------------------------------------------
# real runs
# ---------------------------------------------------------------------------------------------


def figures(run_dir) -> dict[str, list[float]]:
    metrics = read_metrics(run_dir)
    return {"loss": [m["loss"] for m in metrics], "grad_norm": [m["grad_norm"] for m in metrics]}


def assert_same(run, reference, steps):
    assert len(run["loss"]) == steps
    for key in ("loss", "grad_norm"):
        assert run[key] == pytest.approx(reference[key][:steps], rel=TOLERANCE), key


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The reference accumulates the 4 micro-batches the pp x dp runs cut the batch into."""
    root = tmp_path_factory.mktemp("3d")
    plans = {
        "one": (["launcher.nproc_per_node=1", "train.grad_accum_steps=4"], STEPS),
        "zero1_pp2_dp2": ([*PP2_DP2, "strategy=zero1"], STEPS),
    }
    return {
        name: run_training(
            root / name,
            [*COMMON, f"train.steps={steps}", *overrides],
            plugins=[inhouse.RecordLayout()],
        )
        for name, (overrides, steps) in plans.items()
    }


@pytest.mark.slow
def test_zero1_pp2_dp2_trains_like_one_process(runs):
    inhouse.assert_layout(
        runs["zero1_pp2_dp2"], inhouse.whole_model_shapes(runs["one"]), dp=2, pp=2
    )
    assert_same(figures(runs["zero1_pp2_dp2"]), figures(runs["one"]), STEPS)


@pytest.mark.slow
def test_zero1_pp2_dp2_exports_the_weights_of_one_process(runs, tmp_path):
    """plait export of the pipeline stages' ZeRO-1 checkpoint gives the whole model, equal to the
    one-process run's export (the same training up to float rounding, as the losses agree)."""
    staged, one = (
        torch.load(export(str(runs[name]), str(tmp_path / f"{name}.pt")), weights_only=True)
        for name in ("zero1_pp2_dp2", "one")
    )
    assert staged.keys() == one.keys()
    for key, tensor in staged.items():
        torch.testing.assert_close(tensor, one[key], rtol=1e-4, atol=2e-5, msg=key)


def stage_params(n_stages: int) -> list[int]:
    """Parameters of each pipeline stage of the run's model (the layers balance)."""
    counts = []
    for stage in range(n_stages):
        model = GPT(n_layer=3)
        part = build_stage_modules(model, split_stages(model, n_stages, "layers"), [stage])
        counts.append(sum(p.numel() for p in part.parameters()))
    return counts


@pytest.mark.slow
def test_zero1_partitions_each_stages_optimizer_states_over_its_dp_group(runs):
    """Optimizer bytes per rank (the largest rank's, measured in the run): the ZeRO paper's
    K·Ψ/N for the largest stage's Ψ and N = dp = 2 (K = 8 in fp32: Adam's two states; the
    optimizer steps the parameter partition itself, ``fp32_master.py``), up to DeepSpeed's
    alignment padding; without partitioning it would be twice that."""
    measured = read_metrics(runs["zero1_pp2_dp2"])[-1]["model_state_bytes/optimizer"]
    largest_stage = max(stage_params(2))
    expected = zero_formula(largest_stage, stage=1, dp=2, precision="fp32").optimizer
    assert expected <= measured <= expected * 1.01
    unpartitioned = zero_formula(largest_stage, stage=1, dp=1, precision="fp32").optimizer
    assert measured < 0.51 * unpartitioned


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "zero1"])
def test_pp2_tp2_dp2_on_8_processes_trains_like_one_process(runs, tmp_path, strategy):
    run = run_training(
        tmp_path / strategy,
        [*COMMON, f"train.steps={STEPS_8}", *PP2_TP2_DP2, f"strategy={strategy}"],
        plugins=[inhouse.RecordLayout()],
    )
    inhouse.assert_layout(run, inhouse.whole_model_shapes(runs["one"]), dp=2, tp=2, pp=2)
    assert_same(figures(run), figures(runs["one"]), STEPS_8)
