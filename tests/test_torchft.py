"""``fault=torchft`` proven with real processes on gloo and torchft's own lighthouse and managers:
two replica groups equal plain DDP step for step while nobody fails; a SIGKILLed process of group
1 leaves group 0 stepping on, with the same processes and no step lost or repeated, while group
1's agent restarts it and it recovers live from group 0 (no checkpoint read) and rejoins, after
which both groups hold the same parameters and optimizer states bit for bit.

The layouts, the global batch of every rank and the settings refused are checked without
processes."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import inhouse
import pytest
import stragglers
import torch

from plait.plan import make_plan
from plait.plugins.data.sharding import GlobalOrderSampler
from plait.plugins.fault.torchft.lighthouse import placement
from plait.plugins.report import report
from plait.testing import (
    GroupsStartTogether,
    compose,
    read_metrics,
    read_wandb_run,
    run_training,
)
from plait.topology import ParallelDims

# not imported here: torchft's Rust logger reads RUST_LOG once, when plait's launcher sets it
if importlib.util.find_spec("torchft") is None:
    pytest.skip("fault=torchft needs the torchft extra (scripts/test.sh)", allow_module_level=True)

STEPS = 6
TWO_GROUPS_OF_TWO = ["parallel.tp=2", "launcher.nproc_per_node=4"]  # dp=2: groups of a tp pair
FT = [
    "fault=torchft",
    "fault.heartbeat_timeout_ms=1000",
    "fault.join_timeout_ms=5000",
    "fault.quorum_tick_ms=50",
]


def group_metrics(run_dir: Path, group: int) -> list[dict]:
    """What a group's first rank logged: group 0 the run's metrics.jsonl, the others their own."""
    if group == 0:
        return read_metrics(run_dir)
    path = run_dir / "replica_groups" / str(group) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def embedded(html: str) -> dict[str, dict]:
    """The data a report embeds beside each figure, by figure."""
    pattern = r'<script type="application/json" id="data-([\w]+)">(.*?)</script>'
    return {
        m.group(1): json.loads(m.group(2).replace("<\\/", "</"))
        for m in re.finditer(pattern, html, re.S)
    }


# -- without processes -------------------------------------------------------------------------


def test_a_replica_group_is_a_whole_model_replica_and_takes_its_dp_ranks_share_of_the_batch():
    everyone = ParallelDims(dp=4, tp=2, pp=1, world_size=8)
    group = everyone.one_replica_group(2)
    assert (group.dp, group.tp, group.world_size, group.replica_groups) == (2, 2, 4, 2)
    assert group.data_parallel == everyone.dp
    # rank r of group g takes the share plain DDP's dp rank g * dp + r takes, every step
    plain = [
        GlobalOrderSampler(64, lambda e: torch.randperm(64).numpy(), 8, 1, rank, 4)
        for rank in range(4)
    ]
    for g in range(2):
        for r in range(group.dp):
            mine = GlobalOrderSampler(64, lambda e: torch.randperm(64).numpy(), 8, 1, g * 2 + r, 4)
            assert mine.local_batch_size == plain[g * 2 + r].local_batch_size == 2
            assert mine.dp_rank == plain[g * 2 + r].dp_rank


def test_ddp_and_hsdp_form_replica_groups_and_zero_does_not():
    def groups(overrides):
        plan = make_plan(["fault=torchft", "device=cpu", *overrides])
        return plan.pm.hook.plait_replica_groups(cfg=plan.cfg, dims=plan.dims)

    assert groups(TWO_GROUPS_OF_TWO) == 2  # each dp rank: a tp pair
    assert groups(["launcher.nproc_per_node=4"]) == 4
    assert groups(["strategy=fsdp", "strategy.replicate=2", "launcher.nproc_per_node=4"]) == 2
    assert groups(["strategy=zero2"]) is None


def test_the_lighthouse_runs_on_node_0_or_task_0_and_every_worker_reaches_it_there():
    one = compose(["fault=torchft"])
    assert placement(one, {}) == ("127.0.0.1", 0, True)  # a free port on this machine
    nodes = ["launcher.nnodes=2", "launcher.master_addr=10.0.0.1", "launcher.master_port=29500"]
    nodes += ["run.name=lh"]
    assert placement(compose(["fault=torchft", *nodes]), {}) == ("10.0.0.1", 29501, True)
    second = compose(["fault=torchft", *nodes, "launcher.node_rank=1", "fault.lighthouse_port=7"])
    assert placement(second, {}) == ("10.0.0.1", 7, False)
    task = {
        "SLURM_PROCID": "3",
        "SLURM_STEP_ID": "0",
        "SLURM_JOB_ID": "41",
        "SLURM_JOB_NODELIST": "gpu[07-08]",
    }
    assert placement(one, task) == ("gpu07", 20000 + 41 + 1, False)
    assert placement(one, {**task, "SLURM_PROCID": "0"})[2]


def flat(state, prefix: str = "") -> dict:
    """A nested state (dicts, lists) as ``path -> leaf``."""
    if isinstance(state, dict):
        return {
            k: v for key, value in state.items() for k, v in flat(value, f"{prefix}/{key}").items()
        }
    if isinstance(state, (list, tuple)):
        return {
            k: v for i, value in enumerate(state) for k, v in flat(value, f"{prefix}/{i}").items()
        }
    return {prefix: state}


def equal_bit_for_bit(a: dict, b: dict) -> list[str]:
    """The paths where two states differ (tensors: dtype, shape and every bit)."""
    a, b = flat(a), flat(b)
    differ = sorted(a.keys() ^ b.keys())
    for key in a.keys() & b.keys():
        x, y = a[key], b[key]
        if isinstance(x, torch.Tensor):
            same = x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
        else:
            same = x == y
        if not same:
            differ.append(key)
    return differ


# -- real processes -----------------------------------------------------------------------------


@pytest.mark.alone
@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [
        TWO_GROUPS_OF_TWO,  # ddp: each dp rank (a tp pair) a group
        ["strategy=fsdp", "strategy.replicate=2", "launcher.nproc_per_node=4"],  # HSDP
        # pipeline stages inside each group (a pp pair)
        [
            "parallel.pp=2",
            "pipeline.microbatches=2",
            "train.grad_accum_steps=2",
            "launcher.nproc_per_node=4",
        ],
    ],
    ids=["ddp_tp2", "hsdp", "ddp_pp2"],
)
def test_two_replica_groups_equal_one_job_step_for_step_while_nobody_fails(tmp_path, layout):
    common = [f"train.steps={STEPS}", f"optimizer.decay_steps={STEPS}", *layout]
    plain = read_metrics(run_training(tmp_path / "plain", common))
    # both groups in the first quorum: the run starts together (a later group would recover)
    groups = read_metrics(run_training(tmp_path / "ft", [*common, *FT, "fault.min_replicas=2"]))
    assert [m["step"] for m in groups] == list(range(1, STEPS + 1))
    for one, two in zip(plain, groups):
        assert two["loss"] == pytest.approx(one["loss"], rel=1e-5)
        assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-4)
        assert two["quorum/participants"] == two["quorum/replica_groups"] == 2
        assert "straggler/group" not in two  # nobody is slow
    assert group_metrics(tmp_path / "ft", 1)[-1]["loss"] == groups[-1]["loss"]


@pytest.mark.slow
def test_a_killed_group_recovers_live_from_a_peer_while_the_other_goes_on(tmp_path):
    steps, kill_at, hold_at = 12, 4, 6
    probe = inhouse.ReplicaGroupProbe(kill_at=kill_at, kill_group=1, kill_rank=1, hold_at=hold_at)
    run = run_training(
        tmp_path / "ft",
        [
            f"train.steps={steps}",
            f"optimizer.decay_steps={steps}",
            *TWO_GROUPS_OF_TWO,
            *FT,
            "launcher.max_restarts=1",
            "checkpoint.every=2",  # checkpoints are written, and group 1 does not read them
            "tracker=wandb",  # offline; group 0 tracks the run
        ],
        plugins=[probe, GroupsStartTogether(2)],
    )
    # group 0 logged every step once, never restarted, with the same processes throughout
    survivor = group_metrics(run, 0)
    assert [m["step"] for m in survivor] == list(range(1, steps + 1))
    assert {m["restarts"] for m in survivor} == {0.0}
    for rank in (0, 1):
        taken = [line for line in inhouse.read_probe(run, 0, rank) if "step" in line]
        assert [line["step"] for line in taken] == list(range(1, steps + 1))
        assert len({line["pid"] for line in taken}) == 1
        assert {line["attempt"] for line in taken} == {0}
    # the quorum: both groups, group 0 alone from the killed step on, both again after the rejoin
    participants = [m["quorum/participants"] for m in survivor]
    assert participants[: kill_at - 1] == [2.0] * (kill_at - 1)
    assert participants[kill_at - 1] == 1.0
    assert participants[-1] == 2.0
    alone = [m["step"] for m in survivor if m["quorum/participants"] == 1.0]
    assert alone == list(range(kill_at, alone[-1] + 1))  # one stretch, from the killed step on
    # ... in W&B too, and plait report marks where the quorum changed
    history = read_wandb_run(run)["history"]
    assert [h["quorum/participants"] for h in history] == participants
    html = report([str(run)], str(run / "report.html"))[0].read_text()
    [marks] = embedded(html)["loss_by_step"]["markers"].values()
    assert [(m["kind"], m["step"]) for m in marks] == [
        ("quorum", kill_at),
        ("quorum", alone[-1] + 1),
    ]
    # group 1: restarted by its own agent, recovered from group 0 without asking for a checkpoint
    rejoined = group_metrics(run, 1)
    restarted = [m for m in rejoined if m["restarts"] == 1.0]
    assert restarted and restarted[0]["quorum/recovered"] == 1.0
    assert restarted[0]["step"] == alone[-1] + 1
    for rank in (0, 1):
        lines = inhouse.read_probe(run, 1, rank)
        assert {"load": 1} not in lines, "the restarted group read a checkpoint"
        assert {line["attempt"] for line in lines if "step" in line} == {0, 1}
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*"))  # they were written
    # afterwards both groups hold the same parameters and optimizer states, bit for bit
    for rank in (0, 1):
        mine = torch.load(run / "probe" / f"g0r{rank}.pt", weights_only=False)
        theirs = torch.load(run / "probe" / f"g1r{rank}.pt", weights_only=False)
        assert flat(mine["model"]) and flat(mine["optimizer"]["state"])
        assert equal_bit_for_bit(mine, theirs) == []


@pytest.mark.alone
@pytest.mark.slow
def test_exclude_drops_the_slow_group_from_the_quorum_and_the_others_go_on(tmp_path):
    """Replica group 1 runs sixteen more forwards per step: it is named within the window, leaves
    the quorum (its agent does not restart it: it ends with exit code 0) and group 0 finishes."""
    steps = 14
    run = run_training(
        tmp_path / "ft",
        [
            f"train.steps={steps}",
            f"optimizer.decay_steps={steps}",
            "launcher.nproc_per_node=2",  # two groups of one process
            *FT,
            "fault.straggler_factor=1.3",
            "fault.straggler_window=4",
            "fault.straggler_action=exclude",
            "launcher.max_restarts=1",
        ],
        plugins=[stragglers.ExtraForwardsGroup(1, extra=16), GroupsStartTogether(2)],
    )
    survivor = group_metrics(run, 0)
    assert [m["step"] for m in survivor] == list(range(1, steps + 1))
    named = [m for m in survivor if "straggler/group" in m]
    assert named and {m["straggler/group"] for m in named} == {1.0}
    # seventeen forwards, one backward and optimizer step: between the factor and 17 times the work
    assert 1.3 <= named[0]["straggler/slowdown"] <= 17.9
    # named on the metrics of the step after the one judged: the first logged step left out, a
    # window of 4, then the next step; two more where the busy host blurred a window's median
    # (a suite run here named it at step 9 with eight extra forwards, 1.85x when alone)
    assert named[0]["step"] <= 1 + 4 + 1 + 2
    left = group_metrics(run, 1)
    assert {m["restarts"] for m in left} == {0.0}  # not restarted
    assert left[-1]["step"] < steps
    after = [m["quorum/participants"] for m in survivor if m["step"] > left[-1]["step"]]
    assert after and set(after) == {1.0}
