"""``strategy=fsdp`` (torch FSDP2): the same math as one process, really sharded.

Parity: 20 steps against one process (fp32, clipping off: loss within 1e-5, grad norm within
1e-4, relative) at dp=2, FSDP x tp=2, FSDP x pp=2 (dp=2, 2 micro-batches) and HSDP on 2 nodes x 2
processes (``strategy.replicate=2``, two launcher agents on loopback). Layout: every parameter is
a DTensor sharded over the dp (or shard) mesh, each rank holding 1/shard of it, so a silent
fallback to DDP fails; under pp the ranks are the ``(pp, dp)`` mesh, each stage's dp ranks hold
its half each, stages disjoint (``inhouse.assert_layout``). The pp=2 run's step-10 checkpoint
resumes as itself (steps 11-20 exactly), as fsdp at dp=2 without stages and as fsdp x pp=2 at
dp=1 (within 1e-5). Switch-offs run once under pp: the grad norm not summed over the stages gave
3.67 instead of 5.08 at step 1 (all 20 steps red); checkpoint files named without the pp rank
(both stages' ranks writing one file) failed the resume (``PytorchStreamReader ... archive is
corrupted``). Switch-off run once: without
restoring the tensor-parallel attributes on the sharded parameters the FSDP x tp grad norm was
4.69 instead of 5.08 (red). The gloo ``ReduceOp.AVG`` trap (pytorch#162338) could not be shown
here: on torch 2.13 FSDP2's default reduction also gave parity at dp=2 (switched off once: still
green), so the forced sum-then-divide is kept as the issue asks and proven only as working.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import inhouse
import pytest
from inhouse import RecordShards

from plait.testing import TEST_OVERRIDES, compose, free_port, read_metrics, run_training
from plait.types import PlanError

STEPS = 20
COMMON = [
    f"train.steps={STEPS}",
    f"optimizer.decay_steps={STEPS}",
    "train.grad_clip=0",
    "precision=fp32",
    "checkpoint.save_final=false",
]
LOSS_RTOL, GRAD_NORM_RTOL = 1e-5, 1e-4
LAYOUTS = {
    "dp2": (["strategy=fsdp", "launcher.nproc_per_node=2"], 2, [2], ["dp"]),
    "tp2": (["strategy=fsdp", "parallel.tp=2", "launcher.nproc_per_node=4"], 4, [2], ["dp"]),
    # torchtitan's 3D: each stage chunk an FSDP root over dp, its layers tp-split
    "pp2_tp2": (
        [
            "strategy=fsdp",
            "parallel.pp=2",
            "parallel.tp=2",
            "pipeline.microbatches=2",
            "launcher.nproc_per_node=8",
        ],
        8,
        [2],
        ["dp"],
    ),
}


def assert_sharded(run: Path, ranks: int, mesh: list[int], mesh_dims: list[str]) -> None:
    shard = mesh[-1]
    for rank in range(ranks):
        held = json.loads((run / f"shards_rank{rank}.json").read_text())
        for name, p in held.items():
            assert p["dtensor"] and p["mesh"] == mesh and p["mesh_dims"] == mesh_dims, name
            assert p["placements"][-1] == "S(0)", name  # Shard(dim=0)
            # HSDP: replicas along every other mesh dim, not shards (a shard over both dims
            # would hold 1/4 and pass the size check below)
            assert p["placements"][:-1] == ["R"] * (len(mesh) - 1), name  # Replicate()
            assert p["local"] <= -(-p["global"] // shard) < p["global"], name  # 1/shard of it


def figures(run_dir: Path) -> tuple[list[float], list[float]]:
    metrics = read_metrics(run_dir)
    return [m["loss"] for m in metrics], [m["grad_norm"] for m in metrics]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> tuple[list[float], list[float], dict[str, list[int]]]:
    """Losses, grad norms and the whole model's parameter shapes."""
    run = tmp_path_factory.mktemp("fsdp") / "one"
    run_training(run, [*COMMON, "launcher.nproc_per_node=1"], plugins=[inhouse.RecordLayout()])
    return (*figures(run), inhouse.whole_model_shapes(run))


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_fsdp_equals_one_process_and_really_shards(one_process, layout, tmp_path):
    overrides, ranks, mesh, mesh_dims = LAYOUTS[layout]
    run = tmp_path / layout
    run_training(run, [*COMMON, *overrides], plugins=[RecordShards()])
    losses, norms = figures(run)
    assert len(losses) == STEPS
    assert losses == pytest.approx(one_process[0], rel=LOSS_RTOL)
    assert norms == pytest.approx(one_process[1], rel=GRAD_NORM_RTOL)
    assert_sharded(run, ranks, mesh, mesh_dims)
    if layout == "tp2":  # the tensor-parallel split happened too: qkv holds half its rows
        held = json.loads((run / "shards_rank0.json").read_text())
        assert held["blocks.0.attn.qkv.weight"]["global"] == 3 * 64 * 64 // 2


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["strategy.replicate=3", "launcher.nproc_per_node=4"],
            "strategy.replicate=3 does not divide dp=4",
        ),
        (["comm=ring"], "FSDP reduce-scatters gradients with its own collectives"),
        (
            [
                "parallel.pp=2",
                "pipeline.schedule=zbv",
                "pipeline.virtual_stages=2",
                "launcher.nproc_per_node=2",
            ],
            "pipeline.schedule=zbv with strategy=fsdp: the zero-bubble "
            "schedules split each backward",
        ),
        (
            ["parallel.pp=2", "strategy.replicate=2", "launcher.nproc_per_node=8"],
            "strategy.replicate=2 with parallel.pp=2 and strategy=fsdp: fsdp under pipeline stages is "
            "checked against one process with dp and tp only",
        ),
        (["strategy.offload=cpu", "device=cpu"], "strategy.offload=cpu with device=cpu"),
        (
            ["precision=fp16"],
            "plugin 'fsdp' does not support precision=fp16: choose one of bf16, fp32",
        ),
    ],
)
def test_what_fsdp_cannot_run_is_refused_before_launch(overrides, message):
    with pytest.raises(PlanError) as refused:
        compose(["strategy=fsdp", *overrides])
    assert message in str(refused.value)


PP2 = ["strategy=fsdp", "parallel.pp=2", "pipeline.microbatches=2", "launcher.nproc_per_node=4"]
SAVED = 10


@pytest.fixture(scope="module")
def pp2_run(tmp_path_factory) -> Path:
    """FSDP x pp=2 x dp=2 on 4 processes (stages of one block each), checkpointed at step 10."""
    run = tmp_path_factory.mktemp("fsdp_pp") / "pp2"
    return run_training(
        run,
        [*COMMON, *PP2, f"checkpoint.every={SAVED}", "checkpoint.keep_last=0"],
        plugins=[RecordShards(), inhouse.RecordLayout()],
    )


@pytest.mark.slow
def test_fsdp_under_pipeline_stages_equals_one_process_and_shards_each_stage(one_process, pp2_run):
    """Each stage chunk is its own FSDP root over its stage's dp axis: every rank's parameters
    are DTensors over a 2-rank ``dp`` mesh holding half of its stage's elements, the two dp
    ranks of a stage hold the same names, the stages' names are disjoint and make the model,
    and collectives ran over the dp groups and sends only between the stages."""
    losses, norms = figures(pp2_run)
    assert len(losses) == STEPS
    assert losses == pytest.approx(one_process[0], rel=LOSS_RTOL)
    assert norms == pytest.approx(one_process[1], rel=GRAD_NORM_RTOL)
    assert_sharded(pp2_run, 4, [2], ["dp"])
    inhouse.assert_layout(pp2_run, one_process[2], dp=2, pp=2)
    held = [json.loads((pp2_run / f"shards_rank{r}.json").read_text()) for r in range(4)]
    for rank, stage in enumerate(held):  # rank = pp_rank * 2 + dp_rank
        assert 2 * sum(p["local"] for p in stage.values()) == sum(
            p["global"] for p in stage.values()
        )
        assert stage.keys() == held[rank ^ 1].keys(), rank  # the other dp rank of its stage


@pytest.mark.slow
def test_fsdp_pipeline_checkpoint_resumes_exactly_and_reshards(pp2_run, tmp_path):
    """The step-10 checkpoint of the pp=2 run: each rank's shards and Adam states in files
    named by pp, tp and dp rank resume the same layout with the uninterrupted steps 11-20
    exactly; its layout-free copy (each stage's names, dp shards gathered) resumes as fsdp at
    dp=2 without stages and as fsdp x pp=2 at dp=1 (loaded into stage chunks), the next losses
    within 1e-5."""
    saved = pp2_run / "checkpoints" / f"step_{SAVED:08d}"
    assert sorted(p.name for p in saved.glob("fsdp_*.pt")) == [
        f"fsdp_pp{p}_tp0_dp{d}.pt" for p in range(2) for d in range(2)
    ]
    want = {m["step"]: m["loss"] for m in read_metrics(pp2_run)}
    pp2_dp1 = [*PP2[:-1], "launcher.nproc_per_node=2"]
    for name, layout in (("same", PP2), ("dp2", LAYOUTS["dp2"][0]), ("pp2_dp1", pp2_dp1)):
        resumed = run_training(tmp_path / name, [*COMMON, *layout, f"resume={saved}"])
        got = {m["step"]: m["loss"] for m in read_metrics(resumed)}
        assert sorted(got) == list(range(SAVED + 1, STEPS + 1)), name
        if name == "same":
            assert [got[s] for s in got] == [want[s] for s in got]
        else:
            assert [got[s] for s in got] == pytest.approx([want[s] for s in got], abs=1e-5)


def test_fsdp_with_pipeline_stages_is_planned():
    """fsdp provides ``engine:pipeline`` and ``engine:pipeline_step``: no refusal, and the
    pipeline micro-batches are the step's accumulation micro-batches."""
    cfg = compose(
        ["strategy=fsdp", "parallel.pp=2", "pipeline.microbatches=2", "launcher.nproc_per_node=4"]
    )
    assert cfg.train.grad_accum_steps == 2


@pytest.mark.slow
def test_hsdp_on_two_nodes_equals_one_process(one_process, tmp_path):
    """HSDP on 2 nodes x 2 processes: two launcher agents on loopback (the README's multi-node
    command, no root needed), ``strategy.replicate=2``: each node's two ranks shard the model,
    the nodes are replicas (mesh ``(replicate 2, shard 2)``)."""
    overrides = [
        *TEST_OVERRIDES,
        *COMMON,
        "strategy=fsdp",
        "strategy.replicate=2",
        "launcher.nnodes=2",
        "launcher.nproc_per_node=2",
        "launcher.master_addr=127.0.0.1",
        f"launcher.master_port={free_port()}",
        f"run.root={tmp_path}",
        "run.name=hsdp",
        "+plugins=[inhouse:record_shards]",
    ]
    env = {
        **os.environ,
        "PYTHONPATH": f"{Path(__file__).parent}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    nodes = [
        subprocess.Popen(
            [sys.executable, "-m", "plait", "train", *overrides, f"launcher.node_rank={rank}"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    outputs = [node.communicate(timeout=500)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    losses, norms = figures(tmp_path / "hsdp")
    assert losses == pytest.approx(one_process[0], rel=LOSS_RTOL)
    assert norms == pytest.approx(one_process[1], rel=GRAD_NORM_RTOL)
    assert_sharded(tmp_path / "hsdp", 4, [2, 2], ["replicate", "shard"])


@pytest.mark.slow
def test_fsdp_resumes_from_its_own_checkpoint_exactly(tmp_path):
    """Each rank's shards and Adam states (``save_state``), saved at step 4 of 8: the resumed
    run's steps 5-8 are the uninterrupted run's, exactly."""
    run = [
        "strategy=fsdp",
        "launcher.nproc_per_node=2",
        "train.steps=8",
        "optimizer.decay_steps=8",
        "checkpoint.every=4",
        "checkpoint.keep_last=0",
    ]
    origin = run_training(tmp_path / "origin", run)
    resumed = run_training(
        tmp_path / "resumed", [*run, f"resume={origin / 'checkpoints' / 'step_00000004'}"]
    )
    want = {m["step"]: m["loss"] for m in read_metrics(origin)}
    got = {m["step"]: m["loss"] for m in read_metrics(resumed)}
    assert sorted(got) == [5, 6, 7, 8]
    assert [got[s] for s in got] == [want[s] for s in got]


def _gathered_after_forward(rank, world_size, out):
    import types

    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from plait.plugins.fsdp.materialize import shard
    from plait.plugins.models.gpt import GPT

    mesh = init_device_mesh("cpu", (world_size,))
    dims = types.SimpleNamespace(replica_groups=1, ep=1, dp_cp=world_size)
    topology = types.SimpleNamespace(dims=dims, dp_cp_mesh=lambda: mesh)
    model = shard(compose(["strategy=fsdp"]), GPT(n_layer=2, n_head=2, n_embd=32), topology)
    model(torch.randint(0, 256, (2, 16))).sum()  # a forward: its backward would come next
    if rank == 0:
        kept = {name: not isinstance(p, DTensor) for name, p in model.named_parameters()}
        Path(out).write_text(json.dumps(kept))


@pytest.mark.slow
def test_the_root_keeps_its_parameters_gathered_from_forward_to_backward(tmp_path):
    """As ``fully_shard``'s default (and the plain loop in scripts/parity_loops.py): every block
    frees its gathered parameters after its forward, the root (embedding, final norm, head), whose
    parameters the backward needs first, keeps them instead of gathering them again."""
    from plait.testing import spawn

    out = tmp_path / "kept.json"
    spawn(_gathered_after_forward, 2, str(out))
    kept = json.loads(out.read_text())
    assert {n for n, k in kept.items() if k} == {n for n in kept if not n.startswith("blocks.")}
