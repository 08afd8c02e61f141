"""Build only your part: each rank materializes what it holds, never the whole model, and the
initial weights are the 1-process model's bit for bit (``plait.meta``, ``plait_materialize_
model``), under ZeRO-3 and FSDP at dp=4 and under tp=2 x pp=2.

The model is big enough that a rank holding it whole is unmistakable: 42.6M parameters, 170 MB
in fp32. The libraries a strategy imports while it builds (DeepSpeed, DTensor/FSDP,
pipelining: 30-70 MiB) are imported before the baseline (``plait.testing.ImportFirst``), so the figure
is the model's. Switch-off: with the meta build turned off (``ParameterInit.of`` returning None,
every rank building the whole model) every rank's build peak was 1.00x (zero3) and 1.57x (tp2 x
pp2) the full model, red.
"""

from __future__ import annotations

import json

import pytest
import torch
from inhouse import RecordInitialWeights

from plait.engine.tensor_shards import merge_tensors
from plait.plugins.models.gpt import GPT
from plait.plugins.tensor_parallel.plan import TensorParallelPlan, shard_spec
from plait.testing import ImportFirst, MemoryProbe, run_training

SEED = 7
BIG = dict(vocab_size=256, block_size=64, n_layer=6, n_head=8, n_embd=768)
OVERRIDES = [
    *(f"model.{k}={v}" for k, v in BIG.items()),
    f"seed={SEED}",
    "train.steps=1",
    "train.batch_size=4",
    "train.seq_len=16",
    "optimizer.warmup_steps=0",
    "launcher.nproc_per_node=4",
]
LAYOUTS = {
    "zero3_dp4": ["strategy=zero3"],
    "fsdp_dp4": ["strategy=fsdp"],
    "tp2_pp2": ["parallel.tp=2", "parallel.pp=2", "pipeline.microbatches=2"],
}
LIMIT = 0.6  # of the full model's fp32 bytes, above each rank's resident memory before the build


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    torch.manual_seed(SEED)
    return GPT(**BIG).state_dict()


@pytest.fixture(scope="module", params=list(LAYOUTS))
def built(request, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("meta") / request.param
    libraries = ImportFirst(
        "deepspeed",
        "torch.distributed.fsdp",
        "torch.distributed.pipelining",
        "torch.distributed.checkpoint",
    )
    run_training(
        run_dir,
        [*OVERRIDES, *LAYOUTS[request.param]],
        plugins=[libraries, MemoryProbe(), RecordInitialWeights()],
    )
    return request.param, run_dir


@pytest.mark.slow
def test_no_rank_materializes_the_whole_model(built, reference):
    layout, run_dir = built
    full_bytes = sum(t.numel() * 4 for t in reference.values())
    peaks = [
        json.loads((run_dir / "memory" / f"rank{r}.json").read_text())["build_peak"]
        for r in range(4)
    ]
    assert max(peaks) < LIMIT * full_bytes, (layout, [p / full_bytes for p in peaks])


@pytest.mark.slow
def test_initial_weights_equal_the_one_process_model_bit_for_bit(built, reference):
    layout, run_dir = built
    ranks = [torch.load(run_dir / f"initial_rank{r}.pt") for r in range(4)]
    if layout == "fsdp_dp4":  # dim-0 shards of every parameter, in dp rank order
        for name, full in reference.items():
            parts = [ranks[r][f"{name}#fsdp"] for r in range(4)]
            assert torch.equal(torch.cat(parts), full), name
            assert parts[0].numel() == -(-full.shape[0] // 4) * full[0].numel()  # 1/dp each
        return
    if layout == "zero3_dp4":  # partitions of every parameter, in dp rank order, padded
        for name, full in reference.items():
            flat = torch.cat([ranks[r][f"{name}#zero3"].flatten() for r in range(4)])
            assert torch.equal(flat[: full.numel()], full.flatten()), name
            assert ranks[0][f"{name}#zero3"].numel() == -(-full.numel() // 4)  # 1/dp each
        return
    plan = TensorParallelPlan(GPT.tensor_parallel_plan)
    stages = {}  # pp rank -> [tp shards]; ranks are laid out (pp, dp, tp)
    for r, weights in enumerate(ranks):
        stages.setdefault(r // 2, []).append(weights)
    seen = set()
    for pp_rank, shards in stages.items():
        for name in shards[0]:
            spec = shard_spec(plan, name)
            value = (
                shards[0][name] if spec is None else merge_tensors([s[name] for s in shards], *spec)
            )
            assert torch.equal(value, reference[name]), (pp_rank, name)
            if spec is not None:  # the layout happened: each tp rank holds half
                assert shards[0][name].numel() * 2 == reference[name].numel(), name
            seen.add(name)
    assert seen == set(reference)  # every parameter on exactly the stages that own it
    assert not set(stages[0][0]) & set(stages[1][0])
