"""Activation checkpointing (``train.activation_checkpointing=full|selective``).

In process: the recomputing model gives bit-identical gradients, holds measurably fewer bytes of
activations from its forward for its backward (torch's profiler counts every allocation and free
of the forward: what is still allocated when it ends is what the backward will read), and really
recomputes (counted). Attention runs on SDPA's math kernel here, the one that materialises the
``s x s`` scores (as on a device without a fused kernel): CPU's flash kernel keeps only its output
and log-sum-exp, so selective recompute saves almost nothing there (measured: 0.1%). Before
launch: the refusals. Real runs (slow): under ddp, zero3 and pp=2 x tp=2, each mode gives the same
per-step losses as one process without recompute (fp32; only the summation order of the
data/tensor-parallel reductions differs: rel 2e-5), and the logging rank reports exactly the
recomputes the layout implies.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

from plait import hookimpl
from plait.plugins.activation_checkpointing import RecomputeCounter, apply_activation_checkpointing
from plait.plugins.models.gpt import GPT
from plait.testing import TEST_OVERRIDES, compose, read_metrics, run_training
from plait.types import PlanError, PluginInfo

os.environ.setdefault("DS_ACCELERATOR", "cpu")

# ---------------------------------------------------------------------------------------------
# in process: same gradients, fewer bytes held, recomputes counted
# ---------------------------------------------------------------------------------------------

N_LAYER, BATCH, SEQ, WIDTH, HEADS = 2, 4, 128, 64, 4


def gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(vocab_size=256, block_size=SEQ, n_layer=N_LAYER, n_head=HEADS, n_embd=WIDTH)


def held_bytes_and_grads(model: GPT) -> tuple[int, dict[str, torch.Tensor]]:
    """Bytes the forward leaves allocated for the backward, and the gradients."""
    generator = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, 256, (BATCH, SEQ), generator=generator) for _ in range(2))
    with sdpa_kernel(SDPBackend.MATH):
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as forward:
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
    held = sum(event.self_cpu_memory_usage for event in forward.events())
    return held, {name: p.grad for name, p in model.named_parameters()}


@pytest.fixture(scope="module")
def without_recompute():
    return held_bytes_and_grads(gpt())


# What the math kernel keeps of the attention core: the softmax output, a·s·s·b fp32 per layer.
SCORES = N_LAYER * HEADS * SEQ * SEQ * BATCH * 4


@pytest.mark.parametrize(
    "mode, recomputed, freed_at_least",
    [
        ("full", [f"blocks.{i}" for i in range(N_LAYER)], None),
        ("selective", [f"blocks.{i}.attn.core_attention" for i in range(N_LAYER)], 0.9 * SCORES),
    ],
)
def test_recompute_keeps_gradients_and_holds_fewer_activation_bytes(
    without_recompute, mode, recomputed, freed_at_least
):
    held_plain, grads_plain = without_recompute
    model, counts = gpt(), RecomputeCounter()
    assert apply_activation_checkpointing(model, mode, counts) == recomputed
    assert [name for name, _ in model.named_parameters()] == list(grads_plain)  # names kept
    held, grads = held_bytes_and_grads(model)
    assert counts.take() == N_LAYER  # each planned module ran again in the backward
    for name, grad in grads_plain.items():
        assert torch.equal(grads[name], grad), name
    print(f"{mode}: {held / 2**20:.2f} MiB held vs {held_plain / 2**20:.2f} MiB without")
    if mode == "full":  # blocks keep their inputs only; the embedding, head and loss remain
        assert held < 0.4 * held_plain
    else:
        assert held_plain - held >= freed_at_least


def test_no_recompute_outside_autograd():
    model, counts = gpt(), RecomputeCounter()
    apply_activation_checkpointing(model, "full", counts)
    with torch.no_grad():
        model(torch.zeros(1, 4, dtype=torch.long))
    assert counts.take() == 0


# ---------------------------------------------------------------------------------------------
# refused before launch (no processes)
# ---------------------------------------------------------------------------------------------


class CountsForwardCalls:
    """An in-house plugin that cannot run with recompute, and says so."""

    @hookimpl
    def plait_declare(self):
        return PluginInfo(name="counts_forwards", excludes=frozenset({"activation_checkpointing"}))


def refusal(*overrides: str, plugins=()) -> str:
    with pytest.raises(PlanError) as refused:
        compose([*TEST_OVERRIDES, *overrides], plugins)
    return str(refused.value)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["train.activation_checkpointing=partial"],
            "train.activation_checkpointing=partial: choose one of none, full, selective",
        ),
        (
            ["train.activation_checkpointing=selective", "model=llama_tiny"],
            "train.activation_checkpointing=selective: the model (plait.plugins.hf.llama."
            "build_llama) has no 'selective' entry in its activation_checkpointing_plan (it has: full)",
        ),
        (
            [
                "train.activation_checkpointing=full",
                "model=custom",
                "model._target_=torch.nn.Identity",
            ],
            "plugin 'activation_checkpointing' needs 'model:activation_checkpointing_plan', which no "
            "active plugin provides (installed plugins that provide it: gpt",
        ),
    ],
)
def test_refused_before_launch(overrides, message):
    assert message in refusal(*overrides)


def test_a_plugin_that_declares_it_cannot_recompute_is_refused():
    text = refusal("train.activation_checkpointing=selective", plugins=[CountsForwardCalls()])
    assert (
        "plugin 'counts_forwards' cannot run together with plugin 'activation_checkpointing'"
    ) in text
    compose(TEST_OVERRIDES, [CountsForwardCalls()])  # without recompute it runs


def test_plait_estimate_accounts_for_recompute(capsys):
    """``plait estimate``'s activation line against the bytes autograd saves in a forward of
    the model with that recompute mode applied (within 0.1%: the scalar loss)."""
    from plait import cli
    from plait.plugins.zero.estimate import measure_activation_bytes
    from plait.train import cross_entropy

    printed = {}
    for mode in ("none", "selective", "full"):
        overrides = [
            *TEST_OVERRIDES,
            "strategy=zero1",
            f"train.activation_checkpointing={mode}",
            "precision=fp32",
        ]
        assert cli.main(["estimate", *overrides]) == 0
        line = next(
            line for line in capsys.readouterr().out.splitlines() if line.startswith("activations")
        )
        assert f"activation checkpointing {mode}" in line
        printed[mode] = int(line.rsplit("(", 1)[1].split(" B)")[0].replace(",", ""))
        model = instantiate(compose(overrides).model)
        if mode != "none":
            apply_activation_checkpointing(model, mode)
        ids = torch.randint(0, model.head.out_features, (4, compose(overrides).train.seq_len + 1))
        measured = measure_activation_bytes(model, cross_entropy, ids[:, :-1], ids[:, 1:])
        assert printed[mode] == pytest.approx(measured, rel=1e-3), mode
    assert printed["full"] < printed["selective"] < printed["none"]


# ---------------------------------------------------------------------------------------------
# real runs: the same losses as one process without recompute, recomputes counted
# ---------------------------------------------------------------------------------------------

STEPS = 4
COMMON = [f"train.steps={STEPS}", "model.n_layer=4", "train.grad_accum_steps=2"]
PP2_TP2 = [
    "parallel.pp=2",
    "parallel.tp=2",
    "launcher.nproc_per_node=4",
    "pipeline.microbatches=2",
    "train.grad_accum_steps=1",
]
LAYOUTS = {  # name: (overrides, recomputes of the logging rank per step and planned module)
    "ddp": ([], 4 * 2),  # 4 blocks x 2 accumulation micro-batches
    "zero3": (["strategy=zero3"], 4 * 2),
    "pp2_tp2": (PP2_TP2, 2 * 2),  # 2 blocks on the first stage x 2 pipeline micro-batches
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run = run_training(
        tmp_path_factory.mktemp("ac") / "one", [*COMMON, "launcher.nproc_per_node=1"]
    )
    return [m["loss"] for m in read_metrics(run)]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_recompute_trains_like_one_process_under_every_layout(reference, tmp_path, layout, mode):
    overrides, recomputes = LAYOUTS[layout]
    run = run_training(
        tmp_path / f"{layout}-{mode}",
        [*COMMON, *overrides, f"train.activation_checkpointing={mode}"],
    )
    metrics = read_metrics(run)
    assert [m["loss"] for m in metrics] == pytest.approx(reference, rel=2e-5)
    assert [m["activation_checkpointing/recomputes"] for m in metrics] == [recomputes] * STEPS
