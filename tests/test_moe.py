"""Mixture of experts (``model.n_experts``) and expert parallelism (``parallel.ep``).

Without processes: the router's auxiliary losses against their formulas written out by hand,
capacity drops against a hand-computed routing, the dispatch against a per-token loop, the
auxiliary losses' gradient, experts initialised by their global names under any ``ep``.

With processes (one run each, shared by the tests): the tiny GPT with 4 experts (top 2) in both
blocks, 20 steps, a global batch of 8 sequences in 4 micro-batches of 2 in every run (the
routers' auxiliary losses are per micro-batch, so the reference accumulates the same 4), fp32,
gradient clipping at the default 1.0 (the early norms are above it: a wrong norm over expert
shards changes the losses). Each expert-parallel layout equals the 1-process run within 1e-5 in
loss and 1e-4 (relative) in gradient norm: ep=4 (dp=4, every expert on its own rank), ep=2 x dp
(dp=4: two expert-data-parallel replicas, under ZeRO-2), ep=2 x tp=2, ep=2 x pp=2, ep=2 under
FSDP (2 processes). The ep=4 run saves at step 4; that checkpoint resumes at ep=2 and at ep=1
with the uninterrupted losses.
"""

from __future__ import annotations

import math
import os
from types import SimpleNamespace

import inhouse
import pytest
import torch

from plait.cli import main
from plait.engine.layout_free import saved_shapes
from plait.meta import ParameterInit, build_model, materialize, meta_model
from plait.plan import format_plan, make_plan
from plait.plugin_manager import keep_selected, make_plugin_manager
from plait.plugins.expert_parallel import plait_apply_expert_parallel
from plait.plugins.models.gpt import GPT, MLP
from plait.plugins.models.moe import MoE, load_balancing_loss, route, z_loss
from plait.plugins.planner.cost import Layout, Workload, cost, plugin_axis_cost
from plait.plugins.planner.search import enumerate_layouts
from plait.testing import compose, read_metrics, read_wandb_run, run_training
from plait.types import StrategyCost

os.environ.setdefault("DS_ACCELERATOR", "cpu")

# ---------------------------------------------------------------------------------------------
# formulas, by hand
# ---------------------------------------------------------------------------------------------

LOGITS = [[2.0, 0.0, -1.0], [0.0, 1.0, 0.5], [-0.5, 0.0, 3.0], [1.0, 0.5, 0.0]]


def softmax(row):
    exps = [math.exp(v) for v in row]
    return [e / sum(exps) for e in exps]


def top(row, k):
    return sorted(range(len(row)), key=lambda i: -row[i])[:k]


@pytest.mark.parametrize("router, k", [("softmax", 1), ("softmax", 2), ("sigmoid", 2)])
def test_aux_loss_and_z_loss_equal_their_formulas(router, k):
    """aux = E · Σ_i f_i · P_i (f_i: share of the T·k choices, P_i: mean probability), z = mean
    of the squared log-partition, written out with Python floats."""
    T, E = len(LOGITS), len(LOGITS[0])
    if router == "softmax":
        probs = [softmax(row) for row in LOGITS]
        scores = probs
    else:
        scores = [[1 / (1 + math.exp(-v)) for v in row] for row in LOGITS]
        probs = [[s / sum(row) for s in row] for row in scores]
    chosen = [0] * E
    for row in scores:
        for i in top(row, k):
            chosen[i] += 1
    f = [c / (T * k) for c in chosen]
    P = [sum(p[i] for p in probs) / T for i in range(E)]
    aux = E * sum(fi * pi for fi, pi in zip(f, P))
    z = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in LOGITS) / T

    logits = torch.tensor(LOGITS, dtype=torch.float64)
    routing = route(logits, k, router)
    assert routing.chosen_per_expert.tolist() == chosen
    assert float(load_balancing_loss(routing, k)) == pytest.approx(aux, rel=1e-6)
    assert float(z_loss(logits)) == pytest.approx(z, rel=1e-6)
    if router == "sigmoid":  # DeepSeek-V3: the chosen scores, normalised
        first = [scores[0][i] for i in top(scores[0], k)]
        assert routing.gates[0].tolist() == pytest.approx([s / sum(first) for s in first])


def one_hot_layer(capacity_factor, shared=False):
    """4 experts over 4 features; the router is 5·I, so a token that is 5·e_j goes to expert j."""
    torch.manual_seed(0)
    layer = MoE(
        4, 4, 1, lambda: MLP(4, 0.0, True, 8), shared_expert=shared, capacity_factor=capacity_factor
    )
    with torch.no_grad():
        layer.router.weight.copy_(5 * torch.eye(4))
    return layer


CHOICES = [0, 0, 0, 1, 1, 2, 0, 3]  # expert 0 is chosen 4 times, expert 1 twice


def test_capacity_drops_the_overflow_as_computed_by_hand():
    """8 tokens, 4 experts, top 1, capacity factor 1: each expert takes ceil(1 · 8 · 1 / 4) = 2
    choices, the first ones in token order, so expert 0 keeps tokens 0 and 1 and drops 2 and 6.
    A dropped token's routed output is zero (the residual carries it)."""
    layer = one_hot_layer(capacity_factor=1.0)
    x = 5 * torch.eye(4)[CHOICES]
    routing = route(layer.router(x), 1, capacity_factor=1.0)
    assert routing.experts.flatten().tolist() == CHOICES
    assert routing.kept.flatten().tolist() == [True, True, False, True, True, True, False, True]
    assert routing.dropped == 2
    assert routing.tokens_per_expert.tolist() == [2, 2, 1, 1]
    assert routing.chosen_per_expert.tolist() == [4, 2, 1, 1]

    layer.train()
    out = layer(x)
    assert layer.stats.rows[-1][:4].tolist() == [2, 2, 1, 1]
    assert layer.stats.rows[-1][4].item() == 2  # dropped
    assert out[[2, 6]].abs().sum() == 0
    for t in (0, 1, 3, 4, 5, 7):
        gate = routing.gates[t, 0]
        expected = gate * layer.experts[str(CHOICES[t])](x[t : t + 1])
        torch.testing.assert_close(out[t : t + 1], expected)
    # dropless (the default) computes every choice
    assert route(layer.router(x), 1).dropped == 0


def test_dropless_dispatch_equals_a_loop_over_tokens():
    torch.manual_seed(1)
    layer = MoE(8, 4, 2, lambda: MLP(8, 0.0, True, 16), shared_expert=True)
    x = torch.randn(2, 5, 8)
    out = layer(x)
    tokens = x.reshape(-1, 8)
    probs = layer.router(tokens).softmax(-1)
    for t in range(tokens.shape[0]):
        gates, experts = probs[t].topk(2)
        expected = layer.shared(tokens[t]) + sum(
            g * layer.experts[str(int(e))](tokens[t]) for g, e in zip(gates, experts)
        )
        torch.testing.assert_close(out.reshape(-1, 8)[t], expected, rtol=1e-5, atol=1e-6)


def test_the_auxiliary_losses_reach_the_router_scaled_like_the_micro_batch_loss():
    """The layer's output is unchanged; its backward adds scale · (a·aux + b·z)."""
    torch.manual_seed(2)
    make = lambda: MLP(8, 0.0, True, 16)  # noqa: E731
    layer = MoE(8, 4, 2, make, aux_loss_coeff=0.3, z_loss_coeff=0.2)
    plain = MoE(8, 4, 2, make)
    plain.load_state_dict(layer.state_dict())
    layer.aux_loss_scale = 0.25
    x = torch.randn(3, 4, 8)
    out = layer(x)
    out.sum().backward()
    logits = plain.router(x.reshape(-1, 8))
    routing = route(logits, 2)
    objective = plain(x).sum() + 0.25 * (
        0.3 * load_balancing_loss(routing, 2) + 0.2 * z_loss(logits)
    )
    objective.backward()
    torch.testing.assert_close(layer.router.weight.grad, plain.router.weight.grad)


def test_a_rank_keeps_its_experts_initialised_by_their_global_names():
    """ep=2, rank 1 of its expert-parallel group: on the meta device the layer keeps experts 2
    and 3 under their global names, marked as expert parameters; materialized, they equal the
    1-process model's bit for bit."""
    cfg = compose(["tracker=none", "model.n_experts=4", "seed=7"])
    pm = keep_selected(make_plugin_manager(cfg), cfg)
    model, init = build_model(pm.hook, cfg)
    topology = SimpleNamespace(dims=SimpleNamespace(ep=2), ep_rank=1, group=lambda name: None)
    plait_apply_expert_parallel(cfg=cfg, model=model, topology=topology)
    materialize(model, init)
    assert list(model.blocks["1"].mlp.experts.keys()) == ["2", "3"]
    torch.manual_seed(7)
    whole = GPT(n_experts=4)
    mine = dict(model.named_parameters())
    for name, p in whole.named_parameters():
        if ".experts.0." in name or ".experts.1." in name:
            assert name not in mine
            continue
        assert torch.equal(mine[name], p), name
        assert getattr(mine[name], "allreduce", True) is (".experts." not in name)
    assert isinstance(init, ParameterInit)


def test_routing_figures_are_gathered_on_logged_steps_only(monkeypatch):
    """Issue 32: no routing record, all-to-all timing or figure all-reduce on other steps."""
    from plait.plugins.expert_parallel.dispatch import AllToAllMeter
    from plait.plugins.expert_parallel.engine import MoEEngine
    from plait.types import StepOutput

    torch.manual_seed(0)
    layer = MoE(16, 4, 2, lambda: MLP(16, 0.0, True))
    layer.stats_row, layer.stats_rows = 0, 1
    inner = SimpleNamespace(
        train_step=lambda micro_batches, lr: StepOutput(
            loss=float(layer(micro_batches[0]).sum()), grad_norm=0.0
        )
    )
    topology = SimpleNamespace(tp_rank=0, step_group=None, trainer_ranks=[0])
    meter = AllToAllMeter()
    engine = MoEEngine(inner, [layer], topology, meter, logged=lambda step: step % 2 == 0)
    gathered = []
    monkeypatch.setattr(engine, "figures", lambda forwards: gathered.append(forwards) or {"f": 1})
    seen = []
    for _ in range(4):
        out = engine.train_step([torch.randn(2, 3, 16)], lr=0.1)
        seen.append((layer.record_stats, meter.on, len(layer.stats.rows), "f" in out.metrics))
    assert seen == [
        (False, False, 0, False),
        (True, True, 1, True),
        (False, False, 0, False),
        (True, True, 1, True),
    ]
    assert gathered == [1, 1]


def test_tensor_parallel_plan_splits_experts_and_keeps_the_router():
    model = GPT(n_experts=4, moe_every=2, shared_expert=True)
    plan = model.tensor_parallel_plan
    assert plan["blocks.*.mlp.experts.*.fc"] == "colwise"
    assert plan["blocks.*.mlp.shared.proj"] == "rowwise"
    assert "embed" not in plan  # no sequence parallelism: routing needs the whole sequence
    assert not any("router" in k for k in plan)
    assert GPT(n_experts=4).tensor_parallel_plan.get("blocks.*.mlp.fc") is None  # all MoE


def test_flops_count_the_active_experts():
    dense, moe = GPT(), GPT(n_experts=8, top_k=2)
    router = sum(b.mlp.router.weight.numel() for b in moe.blocks.values())
    assert moe.flops_per_token(64) == dense.flops_per_token(64) + 6 * (
        router + sum(p.numel() for b in dense.blocks.values() for p in b.mlp.parameters())
    )


def test_the_plan_shows_the_expert_groups_and_the_planner_searches_ep():
    """dp=4, ep=2: ep groups [0, 1] and [2, 3] exchange tokens, edp groups [0, 2] and [1, 3]
    average expert gradients. The planner tries every ep that divides dp and the experts, and
    prices the all-to-all."""
    plan = make_plan(
        ["tracker=none", "model.n_experts=4", "parallel.ep=2", "launcher.nproc_per_node=4"]
    ).check()
    groups = plan.backend_configs["expert parallelism (parallel.ep)"]
    assert groups["ep groups (exchange tokens)"] == ["[0, 1]", "[2, 3]"]
    assert groups["edp groups (average expert gradients)"] == ["[0, 2]", "[1, 3]"]
    assert "(dp = edp 2 x ep 2)" in format_plan(plan)
    eps = {(layout.dp, layout.ep) for layout in enumerate_layouts(4, 8, {}, ["ddp"], 6)}
    assert eps == {(4, 1), (4, 2), (2, 1), (2, 2), (1, 1)}  # ep divides dp and the 6 experts
    model = meta_model(plan.pm.hook, plan.cfg)
    work = Workload(
        model,
        8,
        32,
        "fp32",
        1e12,
        1e9,
        lambda *layout: StrategyCost(params=0, grads=0, optimizer=0),
        plugin_axis_cost(plan.pm.hook, plan.cfg, model, 32, "fp32"),
    )
    one, two = (cost(Layout("ddp", 4, 1, 1, 2, 1, "none", ep), work) for ep in (1, 2))
    # 2 layers x 4 x 1/2 x top 2 x 2 x 32 x 64 x 4 bytes, one micro-batch of 2 sequences
    assert (two.comm_s - one.comm_s) * 1e9 == pytest.approx(2 * 4 * 0.5 * 2 * 2 * 32 * 64 * 4)


# ---------------------------------------------------------------------------------------------
# real runs
# ---------------------------------------------------------------------------------------------

STEPS, SAVED = 20, 4
COMMON = [
    "model.n_experts=4",
    "model.top_k=2",
    f"train.steps={STEPS}",
    "train.batch_size=8",
    f"optimizer.decay_steps={STEPS}",
]
LAYOUTS = {
    "one": ["launcher.nproc_per_node=1", "train.grad_accum_steps=4"],
    "ep4": [
        "launcher.nproc_per_node=4",
        "parallel.ep=4",
        "tracker=wandb",
        f"checkpoint.every={SAVED}",
        "checkpoint.keep_last=0",
    ],
    "ep2_dp4_zero2": ["launcher.nproc_per_node=4", "parallel.ep=2", "strategy=zero2"],
    "ep2_tp2": [
        "launcher.nproc_per_node=4",
        "parallel.ep=2",
        "parallel.tp=2",
        "train.grad_accum_steps=2",
    ],
    "ep2_pp2": [
        "launcher.nproc_per_node=4",
        "parallel.ep=2",
        "parallel.pp=2",
        "pipeline.microbatches=2",
    ],
    "ep2_fsdp": [
        "launcher.nproc_per_node=2",
        "parallel.ep=2",
        "strategy=fsdp",
        "train.grad_accum_steps=2",
    ],
}
PROBED = ("one", "ep4", "ep2_dp4_zero2")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {
        name: run_training(
            root / name, [*COMMON, *overrides], [inhouse.ExpertProbe()] if name in PROBED else []
        )
        for name, overrides in LAYOUTS.items()
    }


def figures(run_dir):
    metrics = read_metrics(run_dir)
    return [m["loss"] for m in metrics], [m["grad_norm"] for m in metrics]


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["ep4", "ep2_dp4_zero2", "ep2_tp2", "ep2_pp2", "ep2_fsdp"])
def test_expert_parallel_layouts_train_like_one_process(runs, layout):
    losses, norms = figures(runs[layout])
    want_losses, want_norms = figures(runs["one"])
    assert len(losses) == STEPS
    assert losses == pytest.approx(want_losses, abs=1e-5)
    assert norms == pytest.approx(want_norms, rel=1e-4)


@pytest.mark.slow
def test_each_rank_holds_its_experts_and_exchanges_tokens_by_all_to_all(runs):
    """ep=4: rank r holds expert r of each layer and nothing else; every step it calls
    all_to_all_single 5 times per layer (counts, tokens out and back; the two exchanges again in
    backward), and the bytes counted at torch.distributed are those the run logs. The 1-process
    run holds every expert and calls none."""
    held, counts = inhouse.read_expert_probe(runs["ep4"])
    assert sorted(held) == [0, 1, 2, 3]
    for rank, record in held.items():
        assert record["experts"] == {f"blocks.{b}.mlp": [str(rank)] for b in (0, 1)}
    metrics = read_metrics(runs["ep4"])
    for step, m in enumerate(metrics):
        per_rank = [counts[r][step] for r in range(4)]
        assert {c["calls"] for c in per_rank} == {2 * 5} == {m["moe/all_to_all_calls"]}
        sent = [c["bytes"] for c in per_rank]
        assert min(sent) > 0
        assert m["moe/all_to_all_bytes"] == pytest.approx(sum(sent) / 4)
        assert m["moe/all_to_all_bytes_max"] == max(sent)
        assert m["moe/all_to_all_s"] > 0
    one_held, one_counts = inhouse.read_expert_probe(runs["one"])
    assert one_held[0]["experts"]["blocks.0.mlp"] == ["0", "1", "2", "3"]
    assert {c["calls"] for c in one_counts[0]} == {0}
    assert "moe/all_to_all_bytes" not in read_metrics(runs["one"])[0]


@pytest.mark.slow
def test_zero2_partitions_experts_over_their_replicas_and_the_rest_over_dp(runs):
    """ep=2 of dp=4 under ZeRO-2: DeepSpeed's expert param groups are cut into dp/ep = 2
    partitions, the dense ones into 4; each rank holds 2 of the 4 experts."""
    held, counts = inhouse.read_expert_probe(runs["ep2_dp4_zero2"])
    for rank, record in held.items():
        mine = [str(e) for e in range(2 * (rank % 2), 2 * (rank % 2) + 2)]
        assert record["experts"] == {f"blocks.{b}.mlp": mine for b in (0, 1)}
        groups = record["zero_groups"]
        assert {g["partitions"] for g in groups if g["moe"]} == {2}
        assert {g["partitions"] for g in groups if not g["moe"]} == {4}
        assert sum(g["numel"] for g in groups if g["moe"]) == 2 * 2 * sum(
            p.numel() for p in MLP(64, 0.0, True).parameters()
        )
    assert {c["calls"] for r in counts for c in counts[r]} == {10}


@pytest.mark.slow
def test_routing_metrics_reach_metrics_jsonl_and_wandb(runs):
    """Tokens per expert, imbalance, dropped tokens and the auxiliary losses are the global
    batch's, so they are the same in every layout; W&B's history holds what metrics.jsonl does."""
    one, ep4 = read_metrics(runs["one"]), read_metrics(runs["ep4"])
    tokens = 8 * 32 * 2 / 4  # mean choices per expert and layer: batch x seq x top_k / experts
    for a, b in zip(one, ep4):
        for key in ("moe/tokens_per_expert_min", "moe/tokens_per_expert_max", "moe/dropped_tokens"):
            assert a[key] == b[key], key
        for key in ("moe/aux_loss", "moe/z_loss", "moe/imbalance"):
            assert a[key] == pytest.approx(b[key], rel=1e-5), key
        assert a["moe/tokens_per_expert_min"] <= tokens <= a["moe/tokens_per_expert_max"]
        # every layer computes all 512 choices (dropless): the busiest expert over the mean
        assert a["moe/imbalance"] == pytest.approx(a["moe/tokens_per_expert_max"] / tokens)
        assert a["moe/dropped_tokens"] == 0 and a["moe/aux_loss"] >= 1 - 1e-6
    history = [h for h in read_wandb_run(runs["ep4"])["history"] if "moe/aux_loss" in h]
    assert len(history) == STEPS
    for logged, row in zip(history, ep4):
        for key in [k for k in row if k.startswith("moe/")]:
            assert logged[key] == pytest.approx(row[key]), key


def checkpoint(run_dir):
    return run_dir / "checkpoints" / f"step_{SAVED:08d}"


EXPERT_KEYS = {
    f"blocks.{b}.mlp.experts.{e}.{layer}.{kind}"
    for b in (0, 1)
    for e in range(4)
    for layer in ("fc", "proj")
    for kind in ("weight", "bias")
}


@pytest.mark.slow
def test_the_ep4_checkpoint_holds_every_expert_once_under_its_global_index(runs, tmp_path):
    """The layout-free copy holds exactly the 4 experts of each layer; each rank's own file
    exactly its expert; ``plait export`` writes them all, equal to the per-rank files."""
    saved = checkpoint(runs["ep4"])
    experts = {k for k in saved_shapes(saved) if ".experts." in k}
    assert experts == EXPERT_KEYS
    files = {
        r: torch.load(saved / f"model_pp0_tp0_ep{r}.pt", weights_only=True)["model"]
        for r in range(4)
    }
    for r, state in files.items():
        assert {k for k in state if ".experts." in k} == {
            k for k in EXPERT_KEYS if f".experts.{r}." in k
        }
    assert main(["export", str(saved), f"out={tmp_path / 'all.pt'}"]) == 0
    exported = torch.load(tmp_path / "all.pt", weights_only=True)
    assert {k for k in exported if ".experts." in k} == EXPERT_KEYS
    for key in EXPERT_KEYS:
        owner = int(key.split(".experts.")[1].split(".")[0])
        assert torch.equal(exported[key], files[owner][key]), key


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["ep2_dp4_zero2", "ep2_fsdp"])
def test_export_of_a_layout_free_only_checkpoint_holds_the_trained_model(runs, layout, tmp_path):
    """ZeRO and FSDP under ``ep`` write only the layout-free copy (each expert under its global
    name); ``plait export`` reads it offline (``layout_free.read_model``): every parameter, equal
    to the ep=4 run's export (its per-rank files joined) after the same 20 steps (1e-5)."""
    exports = {}
    for name in ("ep4", layout):
        assert main(["export", str(runs[name]), f"out={tmp_path / name}.pt"]) == 0
        exports[name] = torch.load(tmp_path / f"{name}.pt", weights_only=True)
    assert exports[layout].keys() == exports["ep4"].keys() >= EXPERT_KEYS
    for key, value in exports["ep4"].items():
        torch.testing.assert_close(exports[layout][key], value, rtol=0, atol=1e-5, msg=key)


@pytest.mark.slow
@pytest.mark.parametrize(
    "ep, overrides",
    [
        (2, ["launcher.nproc_per_node=2", "parallel.ep=2", "train.grad_accum_steps=2"]),
        (1, ["launcher.nproc_per_node=1", "train.grad_accum_steps=4"]),
    ],
)
def test_an_ep4_checkpoint_resumes_at_another_ep(runs, tmp_path, ep, overrides):
    """Saved at ep=4 (dp=4) at step 4, resumed at ep=2 (dp=2) and at ep=1 (one process): the
    next losses are the uninterrupted run's (4 steps of the 16 left: the conversion happens once,
    at the resume)."""
    resumed = run_training(
        tmp_path / f"ep{ep}",
        [*COMMON, *overrides, "train.stop_at=8", f"resume={checkpoint(runs['ep4'])}"],
    )
    got = {m["step"]: m["loss"] for m in read_metrics(resumed)}
    want = {m["step"]: m["loss"] for m in read_metrics(runs["ep4"])}
    assert sorted(got) == [5, 6, 7, 8]
    assert [got[s] for s in sorted(got)] == pytest.approx([want[s] for s in sorted(got)], abs=1e-5)
