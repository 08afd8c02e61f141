"""Tensor and sequence parallelism (``parallel.tp``, ``tensor_parallel.sequence_parallel``).

Tolerances (fp32 on CPU, gloo): layer outputs and gradients of the split model equal the unsplit
model's within ``rtol=1e-4, atol=1e-6`` (only the summation order of the split matmuls differs);
per-step training losses within ``rel=1e-5`` and gradient norms within ``rel=1e-4`` of the
single-process run on the same global batch; exported weights within ``atol=1e-5`` after 20 AdamW
steps. Gradient clipping is on in every training comparison (``train.grad_clip=0.05`` is below
every step's norm, so every step is clipped): a wrong tensor-parallel norm would change the losses.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from inhouse import CommCounter, CountCollectives, RecordLayout, assert_layout, whole_model_shapes

from plait.plugins.models.gpt import GPT, Block
from plait.plugins.tensor_parallel.layers import VocabParallelCrossEntropy, split_tensor
from plait.plugins.tensor_parallel.plan import (
    TensorParallelPlan,
    apply_plan,
    merge_shards,
    shard_spec,
)
from plait.testing import compose, read_metrics, run_losses, spawn
from plait.types import PlanError

GPT_PLAN = TensorParallelPlan(GPT.tensor_parallel_plan)

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed (strategy=zero1) on CPU

CLOSE = dict(rtol=1e-4, atol=1e-6)
GRAD_CLIP = "train.grad_clip=0.05"

# ---------------------------------------------------------------------------------------------
# refused before launch (no processes)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (
            ["parallel.tp=3", "launcher.nproc_per_node=3"],
            "parallel.tp=3 does not divide model.n_head=4 (attention heads): choose tp in [1, 2, 4]",
        ),
        (
            ["parallel.tp=2", "model.vocab_size=255"],
            "parallel.tp=2 does not divide model.vocab_size=255 (vocabulary): pad it: "
            "model.vocab_size=256",
        ),
        (
            ["model=llama_tiny", "parallel.tp=2", "model.num_key_value_heads=1"],
            "parallel.tp=2 does not divide model.num_key_value_heads=1 (KV heads)",
        ),
        (
            ["model=llama_tiny", "parallel.tp=2", "model.intermediate_size=129"],
            "parallel.tp=2 does not divide model.intermediate_size=129 (MLP size)",
        ),
        (
            ["tensor_parallel.sequence_parallel=true"],
            "tensor_parallel.sequence_parallel=true needs tensor parallelism: set parallel.tp to 2 or more",
        ),
        (
            ["model=llama_tiny", "parallel.tp=2", "tensor_parallel.sequence_parallel=true"],
            "has no 'sequence_scatter' entry",
        ),
        (
            ["parallel.tp=2", "tensor_parallel.sequence_parallel=true", "train.seq_len=33"],
            "parallel.tp=2 does not divide train.seq_len=33",
        ),
        (["parallel.tp=2", "parallel.dp=2"], "dp(2) * tp(2) * pp(1) != world_size(2)"),
        (["parallel.tp=2", "precision=fp16"], "precision=fp16 with parallel.tp=2 and strategy=ddp"),
        (
            ["parallel.tp=2", "tensor_parallel.plan={blocks.*.mlp.fc: diagonal}"],
            "tensor_parallel.plan: 'blocks.*.mlp.fc' has style 'diagonal'; choose one of colwise",
        ),
        (
            ["parallel.tp=2", "model=custom", "model._target_=torch.nn.Identity"],
            "plugin 'tensor_parallel' needs 'model:tensor_parallel_plan' for parallel.tp=2, which no "
            "active plugin provides (installed plugins that provide it: gpt (model._target_="
            "plait.plugins.models.gpt.GPT), hf (model._target_=plait.plugins.hf.model.build_hf), llama "
            "(model._target_=plait.plugins.hf.llama.build_llama); or set parallel.tp=1)",
        ),
    ],
)
def test_refused_before_launch(overrides, expected):
    with pytest.raises(PlanError) as refused:
        compose(["tracker=none", "launcher.nproc_per_node=2", *overrides])
    assert expected in str(refused.value)


def test_tp_1_is_untouched_and_plain_plans_compose():
    assert compose(
        [
            "tracker=none",
            "parallel.tp=2",
            "tensor_parallel.sequence_parallel=true",
            "launcher.nproc_per_node=2",
        ]
    ).tensor_parallel.sequence_parallel
    cfg = compose(
        [
            "tracker=none",
            "parallel.tp=2",
            "launcher.nproc_per_node=2",
            "tensor_parallel.plan={blocks.*.mlp.fc: colwise, blocks.*.mlp.proj: rowwise}",
        ]
    )
    assert dict(cfg.tensor_parallel.plan) == {
        "blocks.*.mlp.fc": "colwise",
        "blocks.*.mlp.proj": "rowwise",
    }


def test_split_then_merge_gives_the_unsplit_state_dict_and_whole_heads():
    torch.manual_seed(0)
    full = GPT(n_layer=2, n_head=4, n_embd=64).state_dict()
    shards = [
        {
            k: v
            if shard_spec(GPT_PLAN, k) is None
            else split_tensor(v, *shard_spec(GPT_PLAN, k), rank, 2)
            for k, v in full.items()
        }
        for rank in range(2)
    ]
    assert shards[0]["blocks.0.attn.qkv.weight"].shape == (96, 64)
    assert shards[0]["blocks.0.attn.proj.weight"].shape == (64, 32)
    assert shards[1]["embed.tok.weight"].shape == (128, 64)
    # rank 1 holds heads 2 and 3 of each of q, k and v
    q, k, v = full["blocks.0.attn.qkv.weight"].chunk(3)
    torch.testing.assert_close(
        shards[1]["blocks.0.attn.qkv.weight"], torch.cat([q[32:], k[32:], v[32:]]), rtol=0, atol=0
    )
    merged = merge_shards(GPT_PLAN, shards)
    assert merged.keys() == full.keys()
    for key in full:
        torch.testing.assert_close(merged[key], full[key], rtol=0, atol=0)


def test_tied_embeddings_stay_tied_after_the_split():
    model = GPT(n_layer=1, tie_embeddings=True)
    apply_plan(model, GPT_PLAN, group=None, rank=1, size=2, sequence_parallel=False)
    assert model.head.weight is model.embed.tok.weight
    assert model.head.weight.shape == (128, 64)
    assert len(list(model.parameters())) == len({id(p) for p in model.parameters()})


def test_a_plan_pattern_that_matches_nothing_is_refused_before_launch():
    with pytest.raises(PlanError, match=r"match no module of the model: \['blocks.\*.mlp.fc1'\]"):
        compose(
            [
                "tracker=none",
                "launcher.nproc_per_node=2",
                "parallel.tp=2",
                "tensor_parallel.plan={blocks.*.mlp.fc1: colwise}",
            ]
        )


# ---------------------------------------------------------------------------------------------
# split layers (GPT block, GPT, transformers' Llama) equal the unsplit ones, and their
# collectives are Megatron's (2 processes)
# ---------------------------------------------------------------------------------------------

BLOCK_PLAN = TensorParallelPlan(
    styles={
        k.removeprefix("blocks.*."): v
        for k, v in GPT_PLAN.styles.items()
        if k.startswith("blocks.*.")
    },
)


def assert_grads_match(split_model, full_model, plan, rank, tp):
    for name, p in split_model.named_parameters():
        full_grad = full_model.get_parameter(name).grad
        spec = shard_spec(plan, name)
        expected = full_grad if spec is None else split_tensor(full_grad, *spec, rank, tp)
        torch.testing.assert_close(p.grad, expected, **CLOSE, msg=lambda m: f"{name}: {m}")


def check_block(rank, tp, sequence_parallel, counter):
    torch.manual_seed(0)
    full = Block(n_embd=64, n_head=4, dropout=0.0, bias=True)
    split = Block(n_embd=64, n_head=4, dropout=0.0, bias=True)
    split.load_state_dict(full.state_dict())
    apply_plan(split, BLOCK_PLAN, dist.group.WORLD, rank, tp, sequence_parallel)
    x = torch.randn(2, 16, 64)
    dy = torch.randn(2, 16, 64)

    x_full = x.clone().requires_grad_()
    y_full = full(x_full)
    y_full.backward(dy)

    chunk = (lambda t: t.chunk(tp, dim=1)[rank]) if sequence_parallel else (lambda t: t)
    x_split = chunk(x).clone().requires_grad_()
    counter.take()
    y_split = split(x_split)
    forward = counter.take()
    y_split.backward(chunk(dy))
    backward = counter.take()

    torch.testing.assert_close(y_split, chunk(y_full), **CLOSE)
    torch.testing.assert_close(x_split.grad, chunk(x_full.grad), **CLOSE)
    assert_grads_match(split, full, BLOCK_PLAN, rank, tp)
    return forward, backward


def check_gpt(rank, tp, sequence_parallel, counter):
    torch.manual_seed(0)
    full = GPT(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=64)
    torch.manual_seed(0)
    split = GPT(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=64)
    apply_plan(split, GPT_PLAN, dist.group.WORLD, rank, tp, sequence_parallel)
    idx = torch.randint(0, 256, (2, 32))
    targets = torch.randint(0, 256, (2, 32))

    logits_full = full(idx)
    loss_full = F.cross_entropy(logits_full.flatten(0, 1), targets.flatten())
    loss_full.backward()

    counter.take()
    logits_split = split(idx)
    loss = VocabParallelCrossEntropy(dist.group.WORLD, rank)(logits_split, targets)
    loss.backward()
    step = counter.take()

    torch.testing.assert_close(logits_split, logits_full.chunk(tp, dim=-1)[rank], **CLOSE)
    torch.testing.assert_close(loss, loss_full, **CLOSE)
    assert_grads_match(split, full, GPT_PLAN, rank, tp)
    return step


def check_llama(rank, tp, counter):
    from plait.plugins.hf.llama import build_llama

    torch.manual_seed(0)
    full = build_llama()
    torch.manual_seed(0)
    split = build_llama()
    llama_plan = TensorParallelPlan(split.tensor_parallel_plan)  # transformers' own, mapped
    apply_plan(split, llama_plan, dist.group.WORLD, rank, tp, sequence_parallel=False)
    idx = torch.randint(0, 256, (2, 32))
    targets = torch.randint(0, 256, (2, 32))

    logits_full = full(idx)
    F.cross_entropy(logits_full.flatten(0, 1), targets.flatten()).backward()
    counter.take()
    logits_split = split(idx)
    VocabParallelCrossEntropy(dist.group.WORLD, rank)(logits_split, targets).backward()
    step = counter.take()

    torch.testing.assert_close(logits_split, logits_full.chunk(tp, dim=-1)[rank], **CLOSE)
    assert_grads_match(split, full, llama_plan, rank, tp)
    return step


def _layers_equal_unsplit(rank, tp, out_file):
    counts = {}
    with CommCounter() as counter:
        for sp in (False, True):
            forward, backward = check_block(rank, tp, sp, counter)
            counts[f"block sp={sp}"] = {"forward": forward, "backward": backward}
            counts[f"gpt sp={sp}"] = check_gpt(rank, tp, sp, counter)
        counts["llama"] = check_llama(rank, tp, counter)
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump(counts, f)


@pytest.mark.slow
def test_split_layers_equal_unsplit_and_count_megatron_collectives(tmp_path):
    out = tmp_path / "counts.json"
    spawn(_layers_equal_unsplit, 2, str(out))
    counts = json.loads(out.read_text())
    # Megatron (Korthikanti et al. 2022, sec. 4.2): per transformer layer, tensor parallelism
    # takes 2 all-reduces in forward and 2 in backward; with sequence parallelism those become
    # 2 all-gathers + 2 reduce-scatters in each direction.
    assert counts["block sp=False"] == {"forward": {"all_reduce": 2}, "backward": {"all_reduce": 2}}
    # Sequence parallelism also sums the gradients of the replicated parameters that see only a
    # sequence shard: ln_1 and ln_2 weight + bias, and the two row-parallel biases. Megatron does
    # this once per step in one bucket; plait does it in backward, one all-reduce per tensor.
    assert counts["block sp=True"] == {
        "forward": {"all_gather": 2, "reduce_scatter": 2},
        "backward": {"all_gather": 2, "reduce_scatter": 2, "all_reduce": 6},
    }
    # Whole GPT (2 layers), forward + vocab-parallel loss + backward: 4 per layer, 1 for the
    # vocab-parallel embedding, 1 entering the vocab-parallel head (backward), 3 in the
    # vocab-parallel cross-entropy (max, target logit, sum of exponentials).
    assert counts["gpt sp=False"] == {"all_reduce": 4 * 2 + 1 + 1 + 3}
    # With sequence parallelism: the scatter after the embedding costs an all-gather in
    # backward, the head gathers the sequence (all-gather, backward reduce-scatter), the final
    # norm's weight and bias add 2 gradient all-reduces.
    assert counts["gpt sp=True"] == {
        "all_gather": 4 * 2 + 1 + 1,
        "reduce_scatter": 4 * 2 + 1,
        "all_reduce": 6 * 2 + 1 + 3 + 2,
    }
    # transformers' Llama (2 layers) has separate q/k/v and gate/up linears; sharing one region
    # entry per attention / MLP keeps Megatron's 4 all-reduces per layer.
    assert counts["llama"] == {"all_reduce": 4 * 2 + 1 + 1 + 3}


# ---------------------------------------------------------------------------------------------
# training runs: the same per-step losses as one process on the same global batch
# ---------------------------------------------------------------------------------------------

STEPS = 20


def grad_norms(run_dir):
    return [m["grad_norm"] for m in read_metrics(run_dir)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, the tiny GPT, 20 clipped steps, exported at the end."""
    run = tmp_path_factory.mktemp("tp") / "reference"
    losses = run_losses(
        run,
        [f"train.steps={STEPS}", GRAD_CLIP, "launcher.nproc_per_node=1"],
        plugins=[RecordLayout()],
    )
    return run, losses


def gathers_and_scatters(run_dir) -> list[dict[str, int]]:
    """Per step, rank 0's all-gathers and reduce-scatters (counted by ``CountCollectives``)."""
    lines = (run_dir / "collectives.jsonl").read_text().splitlines()
    return [
        {k: v for k, v in json.loads(line).items() if k in ("all_gather", "reduce_scatter")}
        for line in lines
    ]


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    run = tmp_path_factory.mktemp("tp") / "tp2"
    losses = run_losses(
        run,
        [
            f"train.steps={STEPS}",
            GRAD_CLIP,
            "launcher.nproc_per_node=2",
            "parallel.tp=2",
            "checkpoint.every=10",
        ],
        plugins=[CountCollectives(), RecordLayout()],
    )
    return run, losses


@pytest.mark.slow
def test_tp2_trains_like_one_process(reference, tp2):
    (ref_run, ref_losses), (run, losses) = reference, tp2
    assert_layout(run, whole_model_shapes(ref_run), dp=1, tp=2)
    assert len(losses) == STEPS
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert min(grad_norms(run)) > 0.05  # every step was clipped
    assert grad_norms(run) == pytest.approx(grad_norms(ref_run), rel=1e-4)


@pytest.mark.slow
def test_tp2_checkpoint_resumes_and_exports_the_unsplit_model(reference, tp2, tmp_path):
    from plait.export import export

    (ref_run, _), (run, losses) = reference, tp2
    assert sorted(p.name for p in (run / "checkpoints" / "step_00000020").glob("model_*")) == [
        "model_pp0_tp0.pt",
        "model_pp0_tp1.pt",
    ]
    resumed = tmp_path / "resumed"
    later = run_losses(
        resumed,
        [
            f"train.steps={STEPS}",
            GRAD_CLIP,
            "launcher.nproc_per_node=2",
            "parallel.tp=2",
            f"resume={run}/checkpoints/step_00000010",
        ],
    )
    assert later == pytest.approx(losses[10:], rel=1e-6)

    exported = torch.load(export(str(run)), weights_only=True)
    single = torch.load(export(str(ref_run)), weights_only=True)
    model = GPT(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=64)
    model.load_state_dict(exported)  # the plain, unsplit model loads it
    assert exported.keys() == single.keys()
    for key in single:
        torch.testing.assert_close(exported[key], single[key], rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_sequence_parallel_trains_like_plain_tp_with_megatron_collectives(tp2, tmp_path):
    """The same losses and norms as plain tensor parallelism, and the run really was sequence
    parallel: every step's all-reduces in the layers became all-gathers and reduce-scatters
    (the counts of ``gpt sp=True`` above; plain tp has none of either in its layers)."""
    run, losses = tp2
    sp = run_losses(
        tmp_path / "sp",
        [
            f"train.steps={STEPS}",
            GRAD_CLIP,
            "launcher.nproc_per_node=2",
            "parallel.tp=2",
            "tensor_parallel.sequence_parallel=true",
        ],
        plugins=[CountCollectives()],
    )
    assert sp == pytest.approx(losses, rel=1e-5)
    assert grad_norms(tmp_path / "sp") == pytest.approx(grad_norms(run), rel=1e-4)
    # besides the layers' collectives, each step is a logged one (train.log_every=1): the core's
    # StepMeter gathers the ranks' figures in one all-gather
    metrics = 1
    assert gathers_and_scatters(run) == [{"all_gather": metrics}] * STEPS
    assert (
        gathers_and_scatters(tmp_path / "sp")
        == [{"all_gather": 4 * 2 + 1 + 1 + metrics, "reduce_scatter": 4 * 2 + 1}] * STEPS
    )


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "zero1"])
def test_tp2_x_dp2_trains_like_one_process(reference, tmp_path, strategy):
    """DDP, or DeepSpeed ZeRO-1 (the real library, DS_ACCELERATOR=cpu) over the dp axis; the
    export joins the strategy's shards and then the tensor-parallel ones."""
    from plait.export import export

    ref_run, ref_losses = reference
    run = tmp_path / "tp2dp2"
    losses = run_losses(
        run,
        [
            f"train.steps={STEPS}",
            GRAD_CLIP,
            "launcher.nproc_per_node=4",
            "parallel.tp=2",
            f"strategy={strategy}",
        ],
        plugins=[RecordLayout()],
    )
    assert_layout(run, whole_model_shapes(ref_run), dp=2, tp=2)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert grad_norms(run) == pytest.approx(grad_norms(ref_run), rel=1e-4)
    exported = torch.load(export(str(run)), weights_only=True)
    single = torch.load(export(str(ref_run)), weights_only=True)
    assert exported.keys() == single.keys()
    for key in single:
        torch.testing.assert_close(exported[key], single[key], rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_a_plan_given_in_the_config_trains_like_one_process(reference, tmp_path):
    """A user's own plan, no code: only the MLPs split, the rest replicated."""
    plan = "tensor_parallel.plan={blocks.*.mlp.fc: colwise, blocks.*.mlp.proj: rowwise}"
    split = run_losses(
        tmp_path / "two",
        [f"train.steps={STEPS}", GRAD_CLIP, "launcher.nproc_per_node=2", "parallel.tp=2", plan],
    )
    assert split == pytest.approx(reference[1], rel=1e-5)


@pytest.mark.slow
def test_llama_from_transformers_trains_with_tp2_like_unsplit(tmp_path):
    pytest.importorskip("transformers")
    common = ["model=llama_tiny", "train.steps=10", GRAD_CLIP]
    unsplit = run_losses(
        tmp_path / "llama1", [*common, "launcher.nproc_per_node=1"], plugins=[RecordLayout()]
    )
    split = run_losses(
        tmp_path / "llama2",
        [*common, "launcher.nproc_per_node=2", "parallel.tp=2"],
        plugins=[RecordLayout()],
    )
    # the Llama plan cut transformers' q/k/v/o and gate/up/down projections over the tp group
    assert_layout(tmp_path / "llama2", whole_model_shapes(tmp_path / "llama1"), dp=1, tp=2)
    assert split == pytest.approx(unsplit, rel=1e-5)
    assert grad_norms(tmp_path / "llama2") == pytest.approx(
        grad_norms(tmp_path / "llama1"), rel=1e-4
    )
