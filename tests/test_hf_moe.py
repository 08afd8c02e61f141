"""Hugging Face mixtures of experts (Qwen3-MoE, Mixtral) under ``parallel.ep`` (``model=hf``),
through the config's ``base_model_ep_plan``.

Tiny random checkpoints are written here with ``save_pretrained`` (``hf_models.py``: 4 experts
of width 32, top 2; Qwen3-MoE with a dense middle layer, its top 2 not renormalised and its
load-balancing loss in the objective; Mixtral renormalised, stored under ``block_sparse_moe`` as
``w1/w3/w2``). They train on plait's byte data (``data=stdlib``, 256 ids of their 512). No
network.

Without processes: the ep plan's blocks under plait's expert contract, experts by global index
under the checkpoint's names; plait's step-0 loss equal to ``transformers``' forward; HF -> plait
-> HF bit for bit; the refusals.

With processes (one run each, shared): each family 20 steps in one process and at ``ep=2``
(Qwen3-MoE under ddp and under ``pp=2``, 4 processes; Mixtral under FSDP), in micro-batches of 2
sequences, fp32: loss within 1e-5 and grad norm within 1e-4
(relative) of one process; each rank held and read from safetensors only its 2 experts of each
layer, and called ``all_to_all_single`` (counted at ``torch.distributed``, bytes too), so a
silent fallback to replicated experts fails; the checkpoint, ``checkpoint.hf_every`` (its
experts gathered over the ep group) and ``plait export format=hf`` hold every expert once, and
``from_pretrained`` of the written model gives the one-process logits.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import inhouse
import pytest
import torch
import torch.nn.functional as F
from hf_models import MOE_FAMILIES, write_moe_checkpoint

from plait.cli import main
from plait.meta import ParameterInit, materialize, meta_device
from plait.testing import read_metrics, run_training

os.environ.setdefault("DS_ACCELERATOR", "cpu")

STEPS = 20
LOSS, GRAD_NORM = 1e-5, 1e-4  # relative, fp32
BLOCKS = {
    "qwen3_moe": ["model.layers.0.mlp", "model.layers.2.mlp"],
    "mixtral": ["model.layers.0.mlp", "model.layers.1.mlp"],
}
STORED = {
    "qwen3_moe": "model.layers.{l}.mlp.experts.{e}.{w}.weight",
    "mixtral": "model.layers.{l}.block_sparse_moe.experts.{e}.{w}.weight",
}
WEIGHTS = {"qwen3_moe": ("gate_proj", "up_proj", "down_proj"), "mixtral": ("w1", "w3", "w2")}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf_moe")
    return {
        family: write_moe_checkpoint(root / family, family, seed=i)
        for i, family in enumerate(MOE_FAMILIES)
    }


def plait_model(path: Path) -> torch.nn.Module:
    from plait.plugins.hf.model import build_hf

    with meta_device():
        model = build_hf(str(path))
    return materialize(model, ParameterInit.of(model, 0))


def stored_experts(family: str, experts=range(4)) -> set[str]:
    layers = [int(b.split(".")[2]) for b in BLOCKS[family]]
    return {
        STORED[family].format(l=layer, e=e, w=w)
        for layer in layers
        for e in experts
        for w in WEIGHTS[family]
    }


def safetensors_of(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


# ---------------------------------------------------------------------------------------------
# no processes
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_the_ep_plan_puts_each_block_under_plaits_expert_contract(family, checkpoints):
    """The blocks are those whose ``experts`` the ep plan gives ``ep_dispatch_experts``; their
    experts are one module per global index, named as the checkpoint stores them (Mixtral's
    ``block_sparse_moe`` renamed on load as ``transformers`` does); the router is the model's."""
    from plait.plugins.hf.model import build_hf

    with meta_device():
        model = build_hf(str(checkpoints[family]))
    assert model.ep_plan == {
        "model.layers.*.mlp.experts.gate_up_proj": "grouped_gemm",
        "model.layers.*.mlp.experts.down_proj": "grouped_gemm",
        "model.layers.*.mlp.experts": "ep_dispatch_experts",
    }
    assert model.plait_expert_blocks == BLOCKS[family]
    layers = {name: m for name, m in model.named_modules() if getattr(m, "is_moe_layer", False)}
    assert list(layers) == BLOCKS[family]
    for block in layers.values():
        assert (block.n_experts, block.top_k, sorted(block.experts)) == (4, 2, ["0", "1", "2", "3"])
        assert type(block.gate).__module__.startswith("transformers.models.")
    names = {model.plait_names.value[n] for n, _ in model.named_parameters() if ".experts." in n}
    assert names == stored_experts(family)
    assert model.expert_parameter_count() == len(BLOCKS[family]) * 4 * 3 * 64 * 32
    assert model.n_experts == 4  # the planner tries the parallel.ep that divide it


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_step_0_loss_through_plait_equals_transformers_own_forward(family, checkpoints):
    from transformers import AutoModelForCausalLM

    sequence = torch.randint(0, 512, (4, 33), generator=torch.Generator().manual_seed(3))
    logits = plait_model(checkpoints[family])(sequence[:, :-1])
    ours = F.cross_entropy(logits.flatten(0, 1), sequence[:, 1:].flatten())
    hf = AutoModelForCausalLM.from_pretrained(str(checkpoints[family]))
    hf.config.output_router_logits = False  # the cross-entropy alone, as plait reports it
    theirs = hf(input_ids=sequence, labels=sequence).loss
    assert abs(ours.item() - theirs.item()) <= 1e-6, family


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_hf_to_plait_to_hf_without_training_is_bit_exact(family, checkpoints, tmp_path):
    """Every expert written back once, under its stored name (``save_pretrained``'s)."""
    from plait.plugins.hf.writer import write_model

    model = plait_model(checkpoints[family])
    out = write_model(model, model.state_dict(), tmp_path / "out")
    before, after = safetensors_of(checkpoints[family]), safetensors_of(out)
    assert after.keys() == before.keys() and stored_experts(family) <= set(after)
    assert all(torch.equal(after[k], before[k]) for k in before)


def hf_problems(path, *overrides: str) -> str:
    from plait.plan import make_plan

    return "\n".join(
        make_plan(
            [
                "tracker=none",
                "model=hf",
                f"model.path={path}",
                "data=stdlib",
                "train.seq_len=32",
                *overrides,
            ]
        ).problems
    )


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> Path:
    """Config-only directories (``model.pretrained=false``)."""
    import transformers as T

    root = tmp_path_factory.mktemp("configs")
    small = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    T.Qwen2MoeConfig(
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        **small,
    ).save_pretrained(root / "qwen2_moe")
    T.Qwen3MoeConfig(
        moe_intermediate_size=32, num_experts=6, num_experts_per_tok=2, **small
    ).save_pretrained(root / "qwen3_moe6")
    return root


@pytest.mark.parametrize(
    "name, overrides, message",
    [
        (
            "qwen2_moe",
            ["parallel.ep=2", "launcher.nproc_per_node=2"],
            "parallel.ep=2: Qwen2MoeForCausalLM's mixture-of-experts block model.layers.0.mlp cannot be "
            "spread by plait: its block Qwen2MoeSparseMoeBlock is not one plait serves "
            "(Qwen3MoeSparseMoeBlock, MixtralSparseMoeBlock): set parallel.ep=1",
        ),
        (
            "qwen3_moe6",
            ["parallel.ep=4", "launcher.nproc_per_node=4"],
            "parallel.ep=4 does not divide the 6 experts per layer of model.path={configs}/qwen3_moe6 "
            "(num_experts in its config.json): each expert-parallel rank holds num_experts/ep experts; "
            "choose parallel.ep in [1, 2]",
        ),
        (
            "qwen3_moe",
            ["parallel.ep=2", "parallel.cp=2", "launcher.nproc_per_node=4"],
            "parallel.ep=2 with parallel.cp=2: expert parallelism is carved out of the dp ranks alone",
        ),
        (
            "qwen3_moe",
            ["parallel.tp=2", "launcher.nproc_per_node=2"],
            "'model.layers.*.mlp.experts' the style 'moe_tp_experts', which plait does not honour "
            "(plait spreads a mixture of experts' experts with parallel.ep, not by tensor parallelism)",
        ),
        ("qwen3_moe", ["precision=fp16"], "precision=fp16 with model.path="),
    ],
)
def test_what_plait_cannot_serve_is_refused_before_launch(
    name, overrides, message, configs, checkpoints
):
    path = checkpoints[name] if name in checkpoints else configs / name
    pretrained = [] if name in checkpoints else ["model.pretrained=false"]
    assert message.format(configs=configs) in hf_problems(path, *pretrained, *overrides)


def test_a_served_model_at_ep2_plans_without_a_problem(checkpoints):
    assert (
        hf_problems(
            checkpoints["qwen3_moe"], "parallel.ep=2", "launcher.nproc_per_node=2", "strategy=zero2"
        )
        == ""
    )


# ---------------------------------------------------------------------------------------------
# 20 steps at ep=2 against one process
# ---------------------------------------------------------------------------------------------

COMMON = [
    "model=hf",
    "data=stdlib",
    f"train.steps={STEPS}",
    "train.batch_size=8",
    "train.seq_len=32",
    "optimizer.warmup_steps=2",
    f"optimizer.decay_steps={STEPS}",
    "checkpoint.keep_last=1",
]
MICRO_BATCHES = 2  # of 2 sequences per rank and step in every layout (the router's losses are
# per micro-batch): the reference accumulates 4
LAYOUTS = {
    "one": ["launcher.nproc_per_node=1", "train.grad_accum_steps=4"],
    "ep2": [
        "launcher.nproc_per_node=2",
        "parallel.ep=2",
        "train.grad_accum_steps=2",
        "checkpoint.hf_every=20",
    ],
    "ep2_pp2": [
        "launcher.nproc_per_node=4",
        "parallel.ep=2",
        "parallel.pp=2",
        "pipeline.microbatches=2",
        "strategy=ddp",
    ],
}
STRATEGY = {"qwen3_moe": "strategy=ddp", "mixtral": "strategy=fsdp"}


@pytest.fixture(scope="module")
def trained(checkpoints, tmp_path_factory):
    """``trained(family, layout)``: the run directory, trained once per module."""
    root, done = tmp_path_factory.mktemp("runs"), {}

    def run(family: str, layout: str) -> Path:
        if (family, layout) not in done:
            run_dir = root / f"{family}_{layout}"
            strategy = STRATEGY[family] if layout == "ep2" else "strategy=ddp"  # (pp: ddp)
            run_training(
                run_dir,
                [*COMMON, f"model.path={checkpoints[family]}", strategy, *LAYOUTS[layout]],
                plugins=[inhouse.ExpertProbe(), inhouse.RecordReads()],
            )
            done[family, layout] = run_dir
        return done[family, layout]

    return run


def figures(run_dir: Path) -> tuple[list[float], list[float]]:
    metrics = read_metrics(run_dir)
    return [m["loss"] for m in metrics], [m["grad_norm"] for m in metrics]


@pytest.mark.slow
@pytest.mark.parametrize(
    "family, layout", [(f, "ep2") for f in MOE_FAMILIES] + [("qwen3_moe", "ep2_pp2")]
)
def test_ep2_trains_like_one_process(family, layout, trained):
    loss, grad_norm = figures(trained(family, layout))
    loss_1, grad_norm_1 = figures(trained(family, "one"))
    assert len(loss) == STEPS
    assert loss == pytest.approx(loss_1, rel=LOSS)
    assert grad_norm == pytest.approx(grad_norm_1, rel=GRAD_NORM)
    assert loss[-1] < loss[0] - 0.05  # it learned


@pytest.mark.slow
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_each_rank_holds_and_reads_only_its_experts_and_exchanges_tokens_by_all_to_all(
    family, trained, checkpoints
):
    """ep=2: rank r holds experts 2r and 2r+1 of each MoE layer and read from the checkpoint
    only those of the experts (and the dense tensors, under FSDP their halves); every step it calls all_to_all_single 5 times per
    MoE layer (counts, tokens out and back; the two exchanges again in backward), the bytes
    counted at torch.distributed being those the run logs. One process holds every expert and
    calls none."""
    from plait.plugins.hf.checkpoint_files import CheckpointFiles

    run_dir = trained(family, "ep2")
    held, counts = inhouse.read_expert_probe(run_dir)
    files = CheckpointFiles(checkpoints[family])
    numel = {name: torch.Size(e.shape).numel() for name, e in files.entries.items()}
    experts = sum(numel[n] for n in stored_experts(family))
    dense = sum(numel.values()) - experts
    if STRATEGY[family] == "strategy=fsdp":  # its dim-0 half of each dense tensor (all even)
        dense //= 2
    for rank in (0, 1):
        mine = [str(2 * rank), str(2 * rank + 1)]
        assert held[rank]["experts"] == {block: mine for block in BLOCKS[family]}
        read = json.loads((run_dir / f"reads_rank{rank}.json").read_text())["elements"]
        assert read == dense + experts // 2  # its 2 experts of 4, whole (edp has one rank)
    metrics = read_metrics(run_dir)
    for step, m in enumerate(metrics):
        per_rank = [counts[r][step] for r in (0, 1)]
        assert (
            {c["calls"] for c in per_rank}
            == {5 * len(BLOCKS[family]) * MICRO_BATCHES}
            == {m["moe/all_to_all_calls"]}
        )
        sent = [c["bytes"] for c in per_rank]
        assert min(sent) > 0
        assert m["moe/all_to_all_bytes"] == pytest.approx(sum(sent) / 2)
        assert m["moe/all_to_all_bytes_max"] == max(sent)
        # every layer routes all 8 x 32 tokens twice (top 2) in the step: the global batch's
        tokens = [m["moe/tokens_per_expert_min"], m["moe/tokens_per_expert_max"]]
        assert tokens[0] <= 8 * 32 * 2 / 4 <= tokens[1]
    one_held, one_counts = inhouse.read_expert_probe(trained(family, "one"))
    assert one_held[0]["experts"] == {block: ["0", "1", "2", "3"] for block in BLOCKS[family]}
    assert {c["calls"] for c in one_counts[0]} == {0}


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
    root, done = tmp_path_factory.mktemp("export"), {}

    def export(family: str) -> Path:
        if family not in done:
            out = root / family
            assert main(["export", str(trained(family, "ep2")), "format=hf", f"out={out}"]) == 0
            done[family] = out
        return done[family]

    return export


@pytest.mark.slow
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_the_ep2_checkpoint_and_export_hold_every_expert_once(
    family, trained, exported, checkpoints
):
    """The layout-free copy holds each layer's 4 experts under their global names;
    ``checkpoint.hf_every`` (its experts gathered over the ep group) writes exactly the source's
    tensors (every expert once, ``save_pretrained``'s names), ``plait export format=hf`` the same
    bytes (ddp: the per-ep files joined; fsdp: its layout-free copy), and ``from_pretrained`` of
    it gives the logits of the one-process run after the same 20 steps."""
    from transformers import AutoModelForCausalLM

    from plait.engine.layout_free import saved_shapes
    from plait.export import consolidate

    run_dir = trained(family, "ep2")
    saved = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    experts = {k for k in saved_shapes(saved) if ".experts." in k}
    assert {n.replace(".block_sparse_moe.", ".mlp.") for n in stored_experts(family)} == experts
    out = run_dir / "hf" / "step_00000020"  # checkpoint.hf_every=20
    written = safetensors_of(out)
    assert written.keys() == safetensors_of(checkpoints[family]).keys()
    by_export = safetensors_of(exported(family))
    assert by_export.keys() == written.keys()
    assert all(torch.equal(by_export[k], written[k]) for k in written)
    hf = AutoModelForCausalLM.from_pretrained(str(out))
    one = consolidate(str(trained(family, "one")))
    one.model.load_state_dict(one.state, assign=True)
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=x).logits, one.model(x), rtol=0, atol=1e-5)


@pytest.mark.slow
def test_under_pipeline_stages_each_rank_holds_its_stages_experts(trained):
    """ep=2 x pp=2 x dp=2 (ranks laid out (pp, dp)): stage 0 holds MoE layer 0 (and the dense
    layer 1), stage 1 MoE layer 2; the two dp ranks of a stage split its experts, and every rank
    exchanges tokens (5 calls per micro-batch of its one MoE layer; the first step also runs
    each stage once on placeholder inputs to learn the shapes)."""
    run_dir = trained("qwen3_moe", "ep2_pp2")
    held, _ = inhouse.read_expert_probe(run_dir)
    assert {r: record["experts"] for r, record in held.items()} == {
        0: {"model.layers.0.mlp": ["0", "1"]},
        1: {"model.layers.0.mlp": ["2", "3"]},
        2: {"model.layers.2.mlp": ["0", "1"]},
        3: {"model.layers.2.mlp": ["2", "3"]},
    }
    calls = [m["moe/all_to_all_calls"] for m in read_metrics(run_dir)]
    assert calls[1:] == [5 * MICRO_BATCHES] * (STEPS - 1) and calls[0] > 5 * MICRO_BATCHES
    assert all(m["moe/all_to_all_bytes"] > 0 for m in read_metrics(run_dir))
