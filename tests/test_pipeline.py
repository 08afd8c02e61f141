"""Pipeline parallelism: the split (no processes), the refusals before launch (no processes), and
real ``plait train`` runs on gloo compared with one process on the same global batch.

Every multi-process run uses the tiny GPT with 4 blocks and a global batch of 8 sequences cut
into 4 micro-batches; the single-process reference accumulates the same 4 micro-batches
(``train.grad_accum_steps=4``), so the only differences are fp32 summation order: losses, grad
norms and eval losses agree to a relative 2e-5 over 8 steps (past the warm-up, into the decay;
evaluated at steps 4 and 8).
"""

from __future__ import annotations

import copy
import json
import re

import inhouse
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from inhouse import TracePipelineActions

from plait.plan import make_plan
from plait.plugins.models.gpt import GPT
from plait.plugins.pipeline.split import build_stage_modules, n_params, split_stages
from plait.testing import read_metrics, run_training

TOLERANCE = 2e-5  # relative, fp32
BF16_TOLERANCE = 2e-2  # relative per-step loss, bf16 against fp32 (as test_ddp's mixed precision)
STEPS = 8
COMMON = [
    "model.n_layer=4",
    f"train.steps={STEPS}",
    "train.batch_size=8",
    "train.eval_every=4",
    "train.eval_batches=1",
]
PP2 = ["parallel.pp=2", "pipeline.microbatches=4"]


def tiny_gpt(n_layer: int = 6, **kwargs) -> GPT:
    torch.manual_seed(0)
    return GPT(n_layer=n_layer, n_embd=32, n_head=4, block_size=32, **kwargs)


# ---------------------------------------------------------------------------------------------
# the split, no processes
# ---------------------------------------------------------------------------------------------


def test_params_balance_gives_the_stage_with_a_heavy_head_fewer_blocks():
    model = tiny_gpt(n_layer=8)
    model.head = nn.Sequential(nn.Linear(32, 512), nn.GELU(), nn.Linear(512, 256))  # ~150k params
    by_layers = split_stages(model, 2, "layers")
    by_params = split_stages(model, 2, "params")
    assert by_layers.counts == (4, 4)
    assert by_params.counts[-1] < by_layers.counts[-1]
    assert sum(by_params.counts) == 8
    # and the params split really is better balanced by parameter count than 4 + 4
    blocks = list(model.blocks.values())
    four_four = [
        n_params([model.embed, *blocks[:4]]),
        n_params([*blocks[4:], model.norm, model.head]),
    ]
    assert max(by_params.costs) < max(four_four)


def test_layers_balance_and_explicit_counts():
    model = tiny_gpt(n_layer=7)
    assert split_stages(model, 3, "layers").counts == (3, 2, 2)
    assert split_stages(model, 2, [2, 5]).counts == (2, 5)
    with pytest.raises(ValueError, match="pipeline.balance=\\[3, 3\\] must list 2 layer counts"):
        split_stages(model, 2, [3, 3])
    with pytest.raises(ValueError, match="lower parallel.pp"):
        split_stages(model, 8, "layers")


def test_time_balance_uses_the_measured_costs():
    model = tiny_gpt(n_layer=4)
    # a slow head (measured 3 blocks' worth) moves blocks to the first stage
    split = split_stages(model, 2, "time", part_times=[0.0, 1.0, 1.0, 1.0, 1.0, 3.0])
    assert split.counts == (3, 1)


def test_stages_keep_the_original_names_and_unite_into_the_full_model():
    full = tiny_gpt(n_layer=4)
    expected = full.state_dict()
    split = split_stages(full, 4, "layers")
    united = {}
    for rank, stages in enumerate([[0, 3], [1, 2]]):  # the ZBV "V" placement on 2 ranks
        stage = build_stage_modules(tiny_gpt(n_layer=4), split, stages)
        assert [index for index, _ in stage.chunks] == stages
        names = set(stage.state_dict())
        assert not names & set(united)
        united.update(stage.state_dict())
    assert united.keys() == expected.keys()
    assert all(torch.equal(united[k], expected[k]) for k in expected)


def test_a_stage_chunk_computes_its_part_of_the_forward():
    full = tiny_gpt(n_layer=4)
    x = torch.randint(0, 256, (2, 16))
    expected = full(x)
    split = split_stages(full, 2, "layers")
    first = build_stage_modules(tiny_gpt(n_layer=4), split, [0]).chunks[0][1]
    last = build_stage_modules(tiny_gpt(n_layer=4), split, [1]).chunks[0][1]
    torch.testing.assert_close(last(first(x)), expected)


def test_a_users_module_is_cut_by_naming_its_layer_list():
    from plait.plugins.pipeline.split import plan_from_layers

    torch.manual_seed(0)
    model = inhouse.LayerListLM()
    plan = plan_from_layers(model, "layers")
    assert (plan.first, plan.layers, plan.last) == (("embed",), "layers", ("norm", "head"))
    x = torch.randint(0, 256, (2, 8))
    split = split_stages(model, 2, "params", plan=plan)
    stages = [build_stage_modules(copy.deepcopy(model), split, [s], plan=plan) for s in (0, 1)]
    torch.testing.assert_close(stages[1].chunks[0][1](stages[0].chunks[0][1](x)), model(x))
    assert set(stages[0].state_dict()) | set(stages[1].state_dict()) == set(model.state_dict())


# ---------------------------------------------------------------------------------------------
# refused before launch, no processes
# ---------------------------------------------------------------------------------------------


def problems(*overrides: str) -> str:
    return "\n".join(make_plan(["model=gpt_tiny", "tracker=none", *overrides]).problems)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["parallel.pp=2", "pipeline.microbatches=2", "model.n_layer=1"],
            "parallel.pp=2 x 1 stage(s) per rank = 2 pipeline stages, but the model has 1 layers",
        ),
        (
            ["parallel.pp=2", "pipeline.microbatches=3"],
            "pipeline.microbatches=3 does not divide the batch of each data-parallel rank",
        ),
        (
            ["parallel.pp=2", "pipeline.schedule=pipedream"],
            "pipeline.schedule=pipedream: choose one of gpipe, 1f1b, interleaved_1f1b",
        ),
        (
            ["parallel.pp=2", "pipeline.schedule=interleaved_1f1b"],
            "pipeline.schedule=interleaved_1f1b needs pipeline.virtual_stages>=2",
        ),
        (["parallel.pp=2", "pipeline.schedule=zbv"], "set pipeline.virtual_stages=2"),
        (
            ["parallel.pp=2", "pipeline.virtual_stages=2", "model.n_layer=4"],
            "pipeline.virtual_stages=2 needs an interleaved schedule",
        ),
        (
            ["parallel.pp=2", "pipeline.microbatches=1"],
            "pipeline.schedule=1f1b needs pipeline.microbatches >= pp (1 < 2)",
        ),
        (
            ["parallel.pp=2", "pipeline.microbatches=4", "train.grad_accum_steps=2"],
            "train.grad_accum_steps=2 with parallel.pp=2",
        ),
        (
            ["parallel.pp=2", "pipeline.microbatches=2", "pipeline.balance=[1,2]"],
            "pipeline.balance=[1, 2] must list 2 layer counts",
        ),
        (
            ["parallel.pp=2", "pipeline.microbatches=2", "pipeline.balance=speed"],
            "pipeline.balance=speed: choose one of layers, params, time",
        ),
        (
            ["parallel.pp=2", "pipeline.microbatches=2", "precision=fp16", "strategy=zero1"],
            "strategy=zero1 precision=fp16 with parallel.pp=2: the pipeline schedule runs the backward "
            "outside DeepSpeed",
        ),
        (
            ["parallel.pp=2", "pipeline.microbatches=2", "model.tie_embeddings=true"],
            "parallel.pp=2 with a parameter shared by the embedding and the head",
        ),
        (
            [
                "parallel.pp=2",
                "pipeline.microbatches=2",
                "model=custom",
                "model._target_=torch.nn.Linear",
                "+model.in_features=4",
                "+model.out_features=4",
            ],
            "parallel.pp=2: model._target_=torch.nn.Linear has no pipeline_plan: name its layer list (a "
            "ModuleList or ModuleDict of its repeated layers) with pipeline.layers=<module name>, or set "
            "parallel.pp=1",
        ),
        (
            ["parallel.pp=2", "pipeline.microbatches=2", "pipeline.layers=blocks.0"],
            "the pipeline plan's layers 'blocks.0' is not a ModuleList or ModuleDict of GPT",
        ),
        (
            ["parallel.pp=2", "pipeline.microbatches=2", "pipeline.layers=layers"],
            "pipeline.layers=layers: GPT (the model) has no child 'layers'",
        ),
        (
            [
                "parallel.pp=2",
                "pipeline.microbatches=2",
                "model=llama_tiny",
                "pipeline.balance=time",
            ],
            "pipeline.balance=time times each layer alone, which model._target_=plait.plugins.hf."
            "llama.build_llama's layers cannot run",
        ),
    ],
)
def test_impossible_pipeline_plans_are_refused_before_launch(overrides, message):
    assert message in problems(*overrides)


def test_a_valid_pipeline_plan_sets_accumulation_to_the_microbatches():
    plan = make_plan(
        [
            "model=gpt_tiny",
            "tracker=none",
            "parallel.pp=2",
            "pipeline.microbatches=4",
            "model.n_layer=4",
        ]
    )
    assert plan.problems == []
    assert plan.cfg.train.grad_accum_steps == 4
    assert plan.cfg.train.batch_size == 16  # the global batch does not change with pp


# ---------------------------------------------------------------------------------------------
# real runs
# ---------------------------------------------------------------------------------------------


def figures(run_dir) -> dict:
    """The run's per-step figures and its final weights, exported as one unsplit model."""
    from plait.export import export

    metrics = read_metrics(run_dir)
    return {
        "loss": [m["loss"] for m in metrics],
        "grad_norm": [m["grad_norm"] for m in metrics],
        "eval/loss": [m["eval/loss"] for m in metrics if "eval/loss" in m],
        "weights": torch.load(export(str(run_dir)), weights_only=True),
    }


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, the same global batch in the same 4 micro-batches."""
    run = tmp_path_factory.mktemp("pp") / "reference"
    run_training(
        run,
        [*COMMON, "launcher.nproc_per_node=1", "train.grad_accum_steps=4"],
        plugins=[inhouse.RecordLayout()],
    )
    return {**figures(run), "shapes": inhouse.whole_model_shapes(run)}


def assert_same(run_figures, reference):
    assert len(run_figures["loss"]) == STEPS
    for key in ("loss", "grad_norm", "eval/loss"):
        assert run_figures[key] == pytest.approx(reference[key], rel=TOLERANCE), key
    # The export joins the stages (and tensor-parallel shards) into the unsplit model's names,
    # with the weights one process trained to (as in test_tensor_parallel: AdamW steps turn
    # float rounding into up to ~1e-5 in near-zero weights).
    weights, expected = run_figures["weights"], reference["weights"]
    assert weights.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(
            weights[key], expected[key], rtol=1e-4, atol=1e-5, msg=lambda m: f"{key}: {m}"
        )


def actions(run_dir, rank: int) -> list[tuple[int, str, int]]:
    """(stage, kind, micro-batch) of each action rank ``rank`` ran in the first step, in order
    (recorded by ``TracePipelineActions``)."""
    names = json.loads((run_dir / f"actions_rank{rank}.json").read_text())
    return [
        (int(stage), kind, int(mb))
        for stage, kind, mb in (
            re.fullmatch(r"(\d+)([FBIW])(\d+)", name).groups() for name in names
        )
    ]


# schedule -> (the stages each of the 2 ranks holds, how the backward runs: "B" whole, "IW" split
# into the input's part and the weights' part, which zero-bubble schedules defer into the bubble)
SHAPES = {
    "gpipe": ([{0}, {1}], "B"),
    "1f1b": ([{0}, {1}], "B"),
    "interleaved_1f1b": ([{0, 2}, {1, 3}], "B"),  # stage s on rank s mod 2
    "zero_bubble": ([{0}, {1}], "IW"),
    "zbv": ([{0, 3}, {1, 2}], "IW"),  # the V: down the ranks and back up
}


def assert_schedule_ran(run_dir, name: str) -> None:
    """The order of actions that defines schedule ``name``, as the ranks really ran it."""
    stages, backward = SHAPES[name]
    deferred = []
    for rank in range(2):
        ran = actions(run_dir, rank)
        assert {s for s, _, _ in ran} == stages[rank], (name, rank, ran)
        for s in stages[rank]:
            for mb in range(4):
                kinds = sorted(k for st, k, m in ran if (st, m) == (s, mb))
                assert kinds == (["F", "I", "W"] if backward == "IW" else ["B", "F"]), (s, mb)
        kinds = [k for _, k, _ in ran]
        last_forward = max(i for i, k in enumerate(kinds) if k == "F")
        first_backward = min(i for i, k in enumerate(kinds) if k != "F")
        if name == "gpipe":  # every forward before any backward
            assert last_forward < first_backward, (rank, ran)
        else:  # forwards and backwards alternate once the pipeline is full
            assert first_backward < last_forward, (rank, ran)
        # a weight backward that does not follow its input backward at once fills a bubble
        deferred += [
            a for i, a in enumerate(ran) if a[1] == "W" and ran[i - 1] != (a[0], "I", a[2])
        ]
    assert bool(deferred) == (backward == "IW"), (name, deferred)


@pytest.mark.slow
@pytest.mark.parametrize(
    "schedule",
    [
        ["pipeline.schedule=gpipe", "pipeline.balance=time"],  # any split gives the same losses
        ["pipeline.schedule=1f1b"],
        ["pipeline.schedule=interleaved_1f1b", "pipeline.virtual_stages=2"],
        ["pipeline.schedule=zero_bubble"],
        ["pipeline.schedule=zbv", "pipeline.virtual_stages=2"],
    ],
    ids=lambda s: s[0].split("=")[1],
)
def test_pp2_schedule_matches_one_process(tmp_path, reference, schedule):
    run = tmp_path / "pp2"
    run_training(run, [*COMMON, *PP2, *schedule], plugins=[TracePipelineActions()])
    assert_same(figures(run), reference)
    assert_schedule_ran(run, schedule[0].split("=")[1])


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_pp2_in_mixed_precision_trains_close_to_fp32(tmp_path, reference, precision):
    """bf16 or fp16 autocast inside the schedule (fp16 with the loss scaler the engine applies
    through the schedule's loss), against the fp32 schedule."""
    run = tmp_path / precision
    run_training(run, [*COMMON, *PP2, f"precision={precision}"])
    losses = figures(run)["loss"]
    # fp16's scaler may skip the first steps while it finds its scale (an overflow at the initial
    # 2^16): those repeat the loss they saw, and the run is that many updates behind fp32
    skipped = [int(m.get("skipped_steps", 0)) for m in read_metrics(run)]
    behind = skipped[-1]
    assert skipped == [min(step, behind) for step in range(1, len(skipped) + 1)]  # the first ones
    assert behind <= (1 if precision == "fp16" else 0)
    expected = reference["loss"][:1] * behind + reference["loss"][: len(losses) - behind]
    assert losses == pytest.approx(expected, rel=BF16_TOLERANCE)
    assert losses != reference["loss"]  # autocast really ran


@pytest.mark.slow
def test_pp2_fp16_overflow_on_the_last_stage_skips_the_step_on_both(tmp_path):
    """A loss spike at steps 2 and 3 (``inhouse.OverflowAtSteps``, on the last stage, where the
    loss is) overflows fp16 gradients on both stages: both steps are skipped on every rank
    (weights unchanged bit for bit), counted, and the scale halves each time."""
    run = tmp_path / "fp16"
    run_training(
        run,
        [
            *inhouse.OVERFLOW_RUN,
            "model.n_layer=4",
            "train.batch_size=8",
            "parallel.pp=2",
            "pipeline.microbatches=2",
            "train.grad_accum_steps=2",
            "precision=fp16",
        ],
        plugins=[inhouse.OverflowAtSteps(2, 3)],
    )
    inhouse.assert_steps_2_and_3_skipped(run, scales=[1, 0.5, 0.25, 0.25])


@pytest.mark.slow
def test_pp2_dp2_matches_one_process(tmp_path, reference):
    run = tmp_path / "pp2dp2"
    run_training(
        run,
        [
            *COMMON,
            "launcher.nproc_per_node=4",
            "parallel.pp=2",
            "pipeline.microbatches=2",
            "pipeline.balance=params",
        ],
        plugins=[inhouse.RecordLayout()],
    )
    inhouse.assert_layout(run, reference["shapes"], dp=2, pp=2)
    assert_same(figures(run), reference)


@pytest.mark.slow
def test_pp_resume_continues_with_identical_losses_and_exports_the_full_model(tmp_path):
    settings = [
        *PP2,
        "model.n_layer=4",
        "train.steps=8",
        "checkpoint.every=4",
        "pipeline.schedule=1f1b",
    ]
    whole = tmp_path / "whole"
    run_training(whole, settings)
    checkpoint = whole / "checkpoints" / "step_00000004"
    assert sorted(p.name for p in checkpoint.glob("model_*.pt")) == [
        "model_pp0_tp0.pt",
        "model_pp1_tp0.pt",
    ]
    resumed = tmp_path / "resumed"
    run_training(resumed, [*settings, f"resume={checkpoint}"])
    assert [m["step"] for m in read_metrics(resumed)] == [5, 6, 7, 8]
    whole_losses = [m["loss"] for m in read_metrics(whole)]
    assert [m["loss"] for m in read_metrics(resumed)] == whole_losses[4:]  # bit-identical

    from plait.export import export

    state = torch.load(export(str(whole / "checkpoints" / "step_00000008")), weights_only=True)
    model = GPT(n_layer=4)
    model.load_state_dict(state)  # strict: every name of the unsplit model, nothing else


@pytest.mark.slow
def test_pp2_tp2_matches_one_process(tmp_path, reference):
    """Megatron tensor parallelism inside each stage (4 processes); the global grad norm counts
    each tensor-parallel shard once."""
    run = tmp_path / "pp2tp2"
    run_training(
        run,
        [
            *COMMON,
            *PP2,
            "launcher.nproc_per_node=4",
            "parallel.tp=2",
            "pipeline.schedule=interleaved_1f1b",
            "pipeline.virtual_stages=2",
        ],
        plugins=[inhouse.RecordLayout()],
    )
    inhouse.assert_layout(run, reference["shapes"], dp=1, tp=2, pp=2)
    assert_same(figures(run), reference)


@pytest.mark.slow
def test_a_users_module_trains_in_stages_by_naming_its_layer_list(tmp_path):
    """``model=custom`` with no plan and no plugin, cut by ``pipeline.layers=layers``: each
    stage holds its part, and the first loss is the module's own forward on what it was fed."""
    from inhouse import LayerListLM, RecordFirstBatch, RecordHeld

    run = tmp_path / "custom"
    run_training(
        run,
        [
            "model=custom",
            "model._target_=inhouse.LayerListLM",
            *PP2,
            "pipeline.layers=layers",
            "train.steps=4",
            "train.batch_size=8",
            "seed=5",
        ],
        plugins=[RecordFirstBatch(), RecordHeld()],
    )
    torch.manual_seed(5)  # the models plugin seeds, then instantiates
    model = LayerListLM()
    losses = [
        F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        for x, y in torch.load(run / "first_batch.pt")
    ]
    assert read_metrics(run)[0]["loss"] == pytest.approx(
        torch.stack(losses).mean().item(), abs=1e-5
    )
    held = [json.loads((run / f"held_rank{r}.json").read_text())["params"] for r in (0, 1)]
    parts = [sorted({".".join(name.split(".")[:2]) for name in h}) for h in held]
    assert parts == [
        ["embed.weight", "layers.0", "layers.1"],
        ["head.bias", "head.weight", "layers.2", "layers.3", "norm.bias", "norm.weight"],
    ]
