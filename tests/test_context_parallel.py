"""Context parallelism (``parallel.cp``): ring attention and Ulysses, packed documents, the
compositions with dp, tp and pp, a cp checkpoint resumed without cp, the planner's term, and the
refusals.

The attention maths run in one spawned group of 4 ranks (``_attention_group``), without the
launcher: the exchanges against full attention (fp64, with and without document masks), packed
documents against each document alone, 20 training steps of cp=2 and cp=4 (ring and Ulysses)
against the same loop in one process, the counted K/V exchanges and attention FLOPs (zigzag
against contiguous chunks), and the activation memory each rank keeps. The compositions the issue
names (cp=2 x dp=2, x tp=2, x pp=2) are real ``plait train`` runs against one 1-process run.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from plait.plugins.context_parallel.apply import (
    SequenceShardLoss,
    apply_context_parallel,
    exchange_bytes,
    layout_for,
)
from plait.plugins.context_parallel.layout import SequenceLayout
from plait.plugins.context_parallel.ring import ExchangeStats, RingAttention
from plait.plugins.context_parallel.ulysses import ulysses_attention
from plait.plugins.models.gpt import GPT, CoreAttention, document_ids
from plait.testing import TEST_OVERRIDES, compose, read_metrics, run_training, spawn
from plait.types import PlanError

os.environ.setdefault("DS_ACCELERATOR", "cpu")

LOSS_TOL, NORM_TOL = 1e-5, 1e-4  # the issue's: absolute, fp32, over 20 steps
STEPS = 20
VOCAB, SEQ, BATCH = 64, 48, 4  # the spawned group's GPT and batches
BACKENDS = ("ring", "ulysses")


# ---------------------------------------------------------------------------------------------
# refused before launch (no processes)
# ---------------------------------------------------------------------------------------------


def refusal(*overrides: str) -> str:
    with pytest.raises(PlanError) as refused:
        compose([*TEST_OVERRIDES, *overrides])
    return str(refused.value)


def test_context_parallel_refusals_name_the_combination():
    """The issue's three refusals (and the setting's range) are lines of test_refusals.py;
    these are the combinations cp cannot run with."""
    assert "needs 'model:context_parallel' for parallel.cp=2" in refusal(
        "model=custom", "model._target_=torch.nn.Identity", "parallel.cp=2"
    )
    assert "plugin 'local_sgd' does not support cp parallelism (parallel.cp=2)" in refusal(
        "strategy=local_sgd", "parallel.cp=2"
    )
    assert (
        "model.dropout=0.1 with parallel.cp=2: the attention of context-parallel ranks has "
        "no dropout" in refusal("parallel.cp=2", "model.dropout=0.1")
    )
    assert "dp(1) * cp(2) * tp(2) * pp(1) != world_size(2)" in refusal(
        "parallel.cp=2", "parallel.tp=2", "parallel.dp=1"
    )
    assert (
        "strategy=zero1 with parallel.pp=2 and parallel.cp=2: DeepSpeed sums gradients"
        in refusal(
            "strategy=zero1",
            "parallel.cp=2",
            "parallel.pp=2",
            "pipeline.microbatches=2",
            "launcher.nproc_per_node=4",
        )
    )


def test_context_parallel_plans_name_the_axis():
    cfg = compose([*TEST_OVERRIDES, "parallel.cp=2", "parallel.tp=2", "launcher.nproc_per_node=8"])
    assert (cfg.parallel.cp, cfg.context_parallel.backend) == (2, "ring")
    from plait.plan import format_plan, make_plan

    text = format_plan(
        make_plan([*TEST_OVERRIDES, "parallel.cp=2", "parallel.tp=2", "launcher.nproc_per_node=8"])
    )
    assert "mesh: world_size=8 = pp 1 x dp 2 x cp 2 x tp 2" in text


def test_the_mesh_puts_context_parallel_ranks_between_tensor_and_data_parallel():
    from plait.topology import ParallelDims, mesh_groups

    dims = ParallelDims(dp=2, tp=2, pp=1, world_size=8, cp=2)
    assert mesh_groups(dims, "tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert mesh_groups(dims, "cp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert mesh_groups(dims, "dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert mesh_groups(dims, "dp_cp") == [[0, 2, 4, 6], [1, 3, 5, 7]]  # gradients reduced here


# ---------------------------------------------------------------------------------------------
# the attention maths, in one spawned group of 4 ranks
# ---------------------------------------------------------------------------------------------


def tiny_gpt(n_layer: int = 2, n_embd: int = 32, seq: int = SEQ) -> GPT:
    torch.manual_seed(0)
    return GPT(vocab_size=VOCAB, block_size=seq, n_layer=n_layer, n_head=4, n_embd=n_embd)


def batch_of(step: int, seq: int = SEQ, batch: int = BATCH):
    generator = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, VOCAB, (batch, seq + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def cross_entropy(logits, targets):
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten())


def train_losses(model, loss_fn, group=None, size=1) -> tuple[list[float], list[float]]:
    """20 AdamW steps, gradients (and the reported loss) averaged over ``group`` as the engines
    average over dp x cp, clipped at 1."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses, norms = [], []
    for step in range(STEPS):
        x, y = batch_of(step)
        loss = loss_fn(model(x), y)
        loss.backward()
        loss = loss.detach()
        if group is not None:  # one flat all-reduce, as DDP's bucket, with the loss
            grads = [p.grad for p in model.parameters()]
            flat = torch.cat([loss.view(1)] + [g.flatten() for g in grads])
            dist.all_reduce(flat, group=group)
            flat /= size
            loss = flat[0]
            for g, value in zip(grads, flat[1:].split([g.numel() for g in grads])):
                g.copy_(value.view_as(g))
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())
        losses.append(float(loss))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses, norms


def context_parallel_gpt(
    backend: str, group, size: int, rank: int, stats: ExchangeStats, **model_args
) -> tuple[GPT, SequenceLayout]:
    model = tiny_gpt(**model_args)
    layout = layout_for(backend, model.block_size, size, rank)
    apply_context_parallel(model, backend, layout, group, stats)
    return model, layout


def saved_bytes(model, x) -> int:
    """Bytes of the tensors one forward keeps for its backward (each storage once, parameters
    left out): the activation memory, measured."""
    storages = {}
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t):
        if t.untyped_storage().data_ptr() not in weights:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x).sum()
    loss.backward()
    return sum(storages.values())


PACKED = [[5, 20, 23], [30, 18], [48], [1, 11, 12, 24]]  # document lengths of each sequence


def packed_batch():
    x, y = batch_of(99, batch=len(PACKED))
    positions = torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in PACKED])
    return x, y, positions


def document_losses(logits_of, x, y) -> list[float]:
    """The summed loss of each document of the packed batch; ``logits_of(row, start, n)``."""
    losses = []
    for row, lengths in enumerate(PACKED):
        start = 0
        for n in lengths:
            logits = logits_of(row, start, n)
            losses.append(
                float(F.cross_entropy(logits, y[row, start : start + n], reduction="sum"))
            )
            start += n
    return losses


def _attention_group(rank: int, world: int, out: str) -> None:
    torch.set_num_threads(1)  # 4 ranks on a few cores, as plait's launcher sets OMP_NUM_THREADS
    results = {}
    pair = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    groups = {2: (pair, rank % 2), 4: (dist.group.WORLD, rank)}

    # exchanges against full attention, fp64, with and without packed documents
    torch.manual_seed(1)
    q, k, v, grad = (torch.randn(2, 4, SEQ, 8, dtype=torch.float64) for _ in range(4))
    positions = torch.stack(
        [torch.cat([torch.arange(n) for n in lengths]) for lengths in PACKED[:2]]
    )
    for docs in (None, document_ids(positions)):
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        reference = CoreAttention(0.0)(*full, docs)
        reference.backward(grad)
        for size, (group, cp_rank) in groups.items():
            for backend in BACKENDS:
                layout = layout_for(backend, SEQ, size, cp_rank)
                index = layout.index()
                mine = [t[:, :, index].clone().requires_grad_() for t in (q, k, v)]
                stats = ExchangeStats()
                if backend == "ring":
                    attended = RingAttention.apply(*mine, docs, layout, group, 8**-0.5, stats)
                else:
                    attended = ulysses_attention(CoreAttention(0.0), *mine, docs, group, stats)
                attended.backward(grad[:, :, index])
                errors = [(attended - reference[:, :, index]).abs().max().item()]
                errors += [
                    float((m.grad - f.grad[:, :, index]).abs().max()) for m, f in zip(mine, full)
                ]
                results[f"exact/{backend}/cp{size}/docs{docs is not None}"] = max(errors)
                kv = 2 * q[:, :, : layout.local_len].numel() * q.element_size()
                results[f"exchanges/{backend}/cp{size}"] = [stats.exchanges, stats.bytes_sent, kv]

    # zigzag against contiguous chunks: the attention FLOPs each rank computed, counted
    x, _ = batch_of(0)
    for name, layout in (
        ("zigzag", SequenceLayout.zigzag(SEQ, world, rank)),
        ("contiguous", SequenceLayout.contiguous(SEQ, world, rank, 2)),
    ):
        stats = ExchangeStats()
        model = tiny_gpt()
        apply_context_parallel(model, "ring", layout, dist.group.WORLD, stats)
        model(x).sum().backward()
        flops = torch.tensor([stats.attention_flops], dtype=torch.float64)
        every = [torch.zeros_like(flops) for _ in range(world)]
        dist.all_gather(every, flops)
        results[f"flops/{name}"] = [float(f) for f in every]

    # 20 training steps against the same loop in one process
    results["one"] = train_losses(tiny_gpt(), cross_entropy)
    for size, (group, cp_rank) in groups.items():
        for backend in BACKENDS:
            model, layout = context_parallel_gpt(backend, group, size, cp_rank, ExchangeStats())
            results[f"train/{backend}/cp{size}"] = train_losses(
                model, SequenceShardLoss(cross_entropy, layout), group, size
            )

    # packed documents of uneven lengths against each document alone
    x, y, positions = packed_batch()
    with torch.no_grad():
        model = tiny_gpt()
        packed, leaky = model(x, positions), model(x)  # leaky: without positions (and masks)
        results["packed/alone"] = document_losses(
            lambda row, start, n: model(x[row : row + 1, start : start + n])[0], x, y
        )
        results["packed/one"] = document_losses(
            lambda row, start, n: packed[row, start : start + n], x, y
        )
        results["packed/leaky"] = document_losses(
            lambda row, start, n: leaky[row, start : start + n], x, y
        )
        for backend in BACKENDS:
            group, cp_rank = groups[2]
            model, layout = context_parallel_gpt(backend, group, 2, cp_rank, ExchangeStats())
            local = SequenceShardLoss(
                lambda logits, t: F.cross_entropy(
                    logits.flatten(0, 1), t.flatten(), reduction="sum"
                ),
                layout,
            )(model(x, positions), y)
            dist.all_reduce(local, group=group)
            results[f"packed/{backend}"] = float(local)

    # activation memory of a longer sequence: what each rank keeps for the backward
    long_x, _ = batch_of(7, seq=256, batch=1)
    results["memory/cp1"] = saved_bytes(tiny_gpt(seq=256), long_x)
    for size, (group, cp_rank) in groups.items():
        for backend in BACKENDS:
            model, _ = context_parallel_gpt(backend, group, size, cp_rank, ExchangeStats(), seq=256)
            results[f"memory/{backend}/cp{size}"] = saved_bytes(model, long_x)
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def group_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("cp_group")
    spawn(_attention_group, 4, str(out))
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]


@pytest.mark.slow
def test_ring_and_ulysses_equal_full_attention_with_and_without_documents(group_results):
    """Outputs and the gradients of q, k and v, fp64, cp=2 and cp=4."""
    for results in group_results:
        exact = {k: v for k, v in results.items() if k.startswith("exact/")}
        assert len(exact) == 8
        assert max(exact.values()) < 1e-12, exact


@pytest.mark.slow
def test_key_value_exchanges_are_counted_as_the_theory_says(group_results):
    """One attention forward and backward: ring attention sends the rank's keys and values
    ``C - 1`` times forward, ``C - 1`` times backward with their gradients ``C`` times; Ulysses
    runs 8 all-to-alls. A fallback that gathered full K/V (or none) would count otherwise."""
    for results in group_results:
        for size in (2, 4):
            exchanges, sent, kv = results[f"exchanges/ring/cp{size}"]
            assert exchanges == 3 * size - 2
            assert sent == (3 * size - 2) * kv
            exchanges, sent, kv = results[f"exchanges/ulysses/cp{size}"]
            assert exchanges == 8
            assert sent == 8 * (size - 1) / size * kv / 2
            # the planner's and the benchmark's formula: per layer, batch 2, width 4 x 8, fp64
            for backend in BACKENDS:
                assert results[f"exchanges/{backend}/cp{size}"][1] == exchange_bytes(
                    backend, SEQ, 2, 32, size, 8
                )


@pytest.mark.slow
def test_zigzag_balances_the_attention_flops_that_contiguous_chunks_skew(group_results):
    """Counted per rank at cp=4: zigzag within 10%; contiguous chunks close to ``2C - 1 : 1``."""
    zigzag, contiguous = group_results[0]["flops/zigzag"], group_results[0]["flops/contiguous"]
    assert min(zigzag) > 0 and max(zigzag) / min(zigzag) <= 1.10
    assert max(contiguous) / min(contiguous) >= 2 * 4 - 1.5


@pytest.mark.slow
def test_cp2_and_cp4_ring_and_ulysses_train_like_one_process(group_results):
    """20 steps, fp32: losses within 1e-5, grad norms within 1e-4 of the same loop unsplit."""
    for results in group_results:
        losses, norms = results["one"]
        for size in (2, 4):
            for backend in BACKENDS:
                cp_losses, cp_norms = results[f"train/{backend}/cp{size}"]
                assert len(cp_losses) == STEPS
                assert np.abs(np.subtract(cp_losses, losses)).max() <= LOSS_TOL, (backend, size)
                assert np.abs(np.subtract(cp_norms, norms)).max() <= NORM_TOL, (backend, size)


@pytest.mark.slow
def test_packed_documents_under_cp2_equal_each_document_alone(group_results):
    """The loss of a packed batch (documents of 1 to 48 tokens, across chunk boundaries)
    equals that of running each document alone: document by document in one process, summed
    over the cp ranks under cp=2 with either backend. The same check fails for the batch without
    its positions (attention leaking across documents)."""
    for results in group_results:
        alone = results["packed/alone"]
        assert results["packed/one"] == pytest.approx(alone, rel=1e-5)
        assert results["packed/leaky"] != pytest.approx(alone, rel=1e-5)
        assert sum(results["packed/leaky"]) != pytest.approx(sum(alone), rel=1e-5)
        for backend in BACKENDS:
            assert results[f"packed/{backend}"] == pytest.approx(sum(alone), rel=1e-5), backend


@pytest.mark.slow
def test_activation_memory_per_rank_falls_as_one_over_cp(group_results):
    """Bytes one forward of a 256-token sequence keeps for its backward on each rank, measured
    through saved-tensor hooks: at most 1.1/C of one process's."""
    for results in group_results:
        one = results["memory/cp1"]
        for size in (2, 4):
            for backend in BACKENDS:
                assert results[f"memory/{backend}/cp{size}"] <= 1.1 * one / size, (backend, size)


# ---------------------------------------------------------------------------------------------
# packed shards carry each token's position in its document
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def packed_shards(tmp_path_factory):
    """Byte-token shards of 300 one-line documents of 1 to 60 bytes (``plait prepare``)."""
    from omegaconf import OmegaConf

    from plait.plugins.data.prepare import PrepareDataConfig, prepare

    root = tmp_path_factory.mktemp("packed")
    rng = np.random.default_rng(0)
    lines = ["".join(rng.choice(list("abcdefghij "), size=n)) for n in rng.integers(1, 61, 300)]
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
    data = OmegaConf.structured(PrepareDataConfig(path=str(root / "docs.jsonl")))
    return prepare(data, root / "shards", log=lambda message: None)


def test_packed_samples_restart_positions_at_every_document(packed_shards):
    from plait.plugins.data.index import read_index
    from plait.plugins.data.shard_dataset import LocalShards, ShardDataset

    index = read_index(str(packed_shards))
    dataset = ShardDataset(index, LocalShards(index), 32, "train", True, 0.0, False, 1)
    x, y, positions = dataset.batch(list(range(len(dataset))))
    starts = set(index.documents.tolist())
    for i, row in enumerate(positions.tolist()):
        start = int(dataset.starts[i])
        expected, at = [], 0
        for t in range(32):
            at = 0 if t == 0 or start + t in starts else at + 1
            expected.append(at)
        assert row == expected
    assert (positions[:, 1:] == 0).sum() > len(dataset) // 2  # documents start inside windows
    plain = ShardDataset(index, LocalShards(index), 32, "train", False, 0.0, False, 1)
    assert len(plain.batch([0])) == 2  # unpacked samples stay (inputs, targets)
    assert (
        "data.pack=true passes each token's position in its document to the model "
        "(forward(ids, position_ids)), from which it masks attention across documents; "
        "model._target_=plait.plugins.hf.llama.build_llama takes no position_ids"
        in refusal(
            "model=llama_tiny",
            "data=shards",
            f"data.path={packed_shards}",
            "data.pack=true",
            "data.val_fraction=0",
        )
    )


# ---------------------------------------------------------------------------------------------
# the compositions, as real runs
# ---------------------------------------------------------------------------------------------

COMMON = [f"train.steps={STEPS}", "train.batch_size=8", "train.seq_len=32"]
CP2_DP2 = ["parallel.cp=2", "launcher.nproc_per_node=4", "checkpoint.every=10"]
CP2_TP2 = ["parallel.cp=2", "parallel.tp=2", "launcher.nproc_per_node=4"]
CP2_PP2 = ["parallel.cp=2", "parallel.pp=2", "pipeline.microbatches=2", "launcher.nproc_per_node=4"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, packed_shards):
    """Every run trains on packed documents (1 to 60 tokens in windows of 32), so the
    position_ids pass through the loader, DDP, tensor parallelism and the pipeline schedule."""
    root = tmp_path_factory.mktemp("cp_runs")
    data = ["data=shards", f"data.path={packed_shards}", "data.pack=true", "data.val_fraction=0"]
    plans = {
        "one": ["launcher.nproc_per_node=1"],
        "cp2_dp2": CP2_DP2,
        "cp2_tp2": CP2_TP2,
        "cp2_pp2": CP2_PP2,
    }
    done = {
        name: run_training(root / name, [*COMMON, *data, *overrides])
        for name, overrides in plans.items()
    }
    # the cp=2 x dp=2 checkpoint of step 10, resumed by one process without cp
    done["resumed"] = run_training(
        root / "resumed",
        [
            *COMMON,
            *data,
            "launcher.nproc_per_node=1",
            f"resume={done['cp2_dp2'] / 'checkpoints' / 'step_00000010'}",
        ],
    )
    return {name: read_metrics(path) for name, path in done.items()}


def assert_trains_like(run: list[dict], reference: list[dict]) -> None:
    assert [m["step"] for m in run] == [m["step"] for m in reference]
    for key, tolerance in (("loss", LOSS_TOL), ("grad_norm", NORM_TOL)):
        got, want = [m[key] for m in run], [m[key] for m in reference]
        assert np.abs(np.subtract(got, want)).max() <= tolerance, key


@pytest.mark.slow
@pytest.mark.parametrize("name", ["cp2_dp2", "cp2_tp2", "cp2_pp2"])
def test_cp2_composes_with_dp_tp_and_pp_like_one_process(runs, name):
    """The loss is averaged over the cp group and cp ranks join the gradient reduction: on
    packed documents, losses within 1e-5 and grad norms within 1e-4 of one process over 20
    steps, while rank 0's attention sent exactly the ring's bytes every step (a fallback to full
    attention sends none)."""
    assert_trains_like(runs[name], runs["one"])
    # rank 0's micro-batches: 8 sequences over dp, 32 tokens, the tiny GPT's 64 wide keys
    # over tp, fp32
    micro = {"cp2_dp2": 4, "cp2_tp2": 8, "cp2_pp2": 4}[name]
    microbatches = 2 if name == "cp2_pp2" else 1
    width = 64 // (2 if name == "cp2_tp2" else 1)
    per_step = exchange_bytes("ring", 32, micro, width, 2, 4) * microbatches
    layers = 1 if name == "cp2_pp2" else 2  # a pipeline stage holds one of the two blocks
    for m in runs[name]:
        # torch's PipelineStage infers its shapes with one more forward in the first step
        extra = 1 if name == "cp2_pp2" and m["step"] == 1 else 0
        block = exchange_bytes("ring", 32, micro, width, 2, 4) / (3 * 2 - 2)  # one K/V send
        assert m["context_parallel/exchange_bytes"] == layers * per_step + extra * block
        assert m["context_parallel/exchanges"] == layers * microbatches * (3 * 2 - 2) + extra


@pytest.mark.slow
def test_a_cp_checkpoint_resumes_without_cp(runs):
    """cp shards no parameter: the cp=2 x dp=2 run's step-10 checkpoint, resumed by one process,
    continues with the losses of the uninterrupted 1-process run."""
    assert_trains_like(runs["resumed"], runs["one"][10:])


# ---------------------------------------------------------------------------------------------
# the planner
# ---------------------------------------------------------------------------------------------


def test_the_planner_enumerates_cp_with_its_activation_term():
    """``plait plan --search`` over dp x cp (tp and pp fixed at 1): at a budget only a sequence
    split over 4 ranks fits, the accepted layouts are cp=4; per micro-batch of one sequence
    each estimate keeps 1/cp of the activations."""
    from plait.plugins.planner import search_layouts

    args = [
        "--search",
        "world_size=4",
        "--memory-gb",
        "0.012",
        "--top",
        "3",
        *TEST_OVERRIDES,
        "train.seq_len=2048",
        "model.block_size=2048",
        "train.batch_size=4",
        "train.peak_flops=1e12",
        "strategy=ddp",
        "parallel.tp=1",
        "parallel.pp=1",
        "train.activation_checkpointing=none",
    ]
    result, table, *_ = search_layouts(args)
    assert result.accepted and all(layout.cp == 4 for layout, _ in result.accepted), table
    by_cp = {
        layout.cp: cost.memory_bytes
        for layout, cost in result.estimates
        if layout.micro_batch_size == 1
    }
    assert by_cp[4] < by_cp[2] < by_cp[1]
    assert "  cp " in table.splitlines()[1]
