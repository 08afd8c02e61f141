"""Parameter servers (sync and async), local SGD and DiLoCo: processes with roles.

Real runs of ``plait train`` (gloo, CPU). Sync parameter servers and local SGD / DiLoCo with
H=1 are compared with 1 process on the same global batch (fp32; relative tolerance 1e-5 for
summation order: the servers average the workers' mean gradients, 1 process sums micro-batches).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import inhouse
import pytest
import torch

from plait.plan import format_plan, make_plan
from plait.plugins.parameter_server.sharding import shard_by_bytes
from plait.testing import TEST_OVERRIDES, SlowRank, read_metrics, run_training, spawn
from plait.topology import Roles

REL = 1e-5
STEPS = ("train.steps=5",)
# 2 workers x 2 micro-batches of 2 = 1 process x 4 micro-batches: the same global batch of 8.
ONE = ("launcher.nproc_per_node=1", "train.grad_accum_steps=4")
TWO = ("train.grad_accum_steps=2",)


def problems(*overrides: str) -> str:
    return "\n".join(make_plan(["tracker=none", *overrides]).problems)


def losses_and_norms(run_dir: Path) -> list[float]:
    """Every step's loss, then every step's grad norm."""
    metrics = read_metrics(run_dir)
    return [m["loss"] for m in metrics] + [m["grad_norm"] for m in metrics]


# ---------------------------------------------------------------------------------------------
# no processes: sharding, roles, refusals
# ---------------------------------------------------------------------------------------------


def test_shards_are_balanced_by_bytes():
    # one big tensor and many small ones: greedy by size puts the big one alone
    assert shard_by_bytes([100, 10, 10, 10, 40, 30], 2) == [0, 1, 1, 1, 1, 1]
    assert shard_by_bytes([8, 8, 8, 8], 2) == [0, 1, 0, 1]


def test_roles_give_every_rank_one_role_and_leave_a_trainer():
    assert Roles.resolve(None, 3).trainers == [0, 1, 2]
    with pytest.raises(ValueError, match="exactly one role"):
        Roles.resolve(Roles({"server": (0,), "trainer": (0, 1)}), 2)
    with pytest.raises(ValueError, match="leave no trainer"):
        Roles.resolve(Roles({"server": (0, 1)}), 2)


def test_plan_shows_roles_and_the_trainers_mesh():
    text = format_plan(
        make_plan(
            [
                "tracker=none",
                "strategy=parameter_server",
                "strategy.servers=1",
                "launcher.nproc_per_node=3",
            ]
        )
    )
    assert "mesh: world_size=2 trainers = pp 1 x dp 2 x tp 1" in text
    assert "roles: server [0], trainer [1, 2]" in text


def test_bad_settings_are_refused_before_launch():
    ps = ("strategy=parameter_server", "launcher.nproc_per_node=2")
    assert (
        "strategy.servers=2 leaves no worker among the 2 processes launched: set "
        "strategy.servers below 2"
    ) in problems(*ps, "strategy.servers=2")
    assert "plugin 'parameter_server' does not support tp parallelism (parallel.tp=2)" in problems(
        "strategy=parameter_server",
        "strategy.mode=async",
        "launcher.nproc_per_node=3",
        "parallel.tp=2",
    )
    assert "strategy.mode=eventually: choose sync" in problems(*ps, "strategy.mode=eventually")
    assert "strategy.sync_every=0 is out of range" in problems(
        "strategy=local_sgd", "strategy.sync_every=0"
    )
    assert "strategy.sync_every=0 is out of range" in problems(
        "strategy=diloco", "strategy.sync_every=0"
    )
    # ZeRO is another strategy: its settings have no servers
    with pytest.raises(Exception, match="servers"):
        make_plan(["tracker=none", "strategy=zero2", "strategy.servers=1"])


# ---------------------------------------------------------------------------------------------
# sync parameter servers = 1 process on the global batch
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    run = tmp_path_factory.mktemp("one") / "r"
    run_training(run, [*STEPS, *ONE])
    return losses_and_norms(run)


def sync_overrides(servers: int) -> list[str]:
    return [
        *STEPS,
        *TWO,
        "strategy=parameter_server",
        f"strategy.servers={servers}",
        f"launcher.nproc_per_node={servers + 2}",
        "checkpoint.every=2",
    ]


@pytest.fixture(scope="module")
def sync_runs(tmp_path_factory):
    """Uninterrupted sync runs by number of servers, made once per module when first asked."""
    runs = {}

    def run(servers: int) -> Path:
        if servers not in runs:
            runs[servers] = tmp_path_factory.mktemp(f"sync{servers}") / "r"
            run_training(runs[servers], sync_overrides(servers))
        return runs[servers]

    return run


def server_log(run: Path, server: int) -> list[dict]:
    return [
        json.loads(line) for line in (run / f"ps_server{server}.jsonl").read_text().splitlines()
    ]


@pytest.mark.slow
@pytest.mark.parametrize("servers", [1, 2])
def test_sync_parameter_servers_match_one_process(one_process, sync_runs, servers):
    run = sync_runs(servers)
    assert losses_and_norms(run) == pytest.approx(one_process, rel=REL)
    # the first trainer logged (rank `servers`), and every server applied every step
    for s in range(servers):
        log = server_log(run, s)
        assert [e["version"] for e in log if e["worker"] == servers] == [1, 2, 3, 4, 5]
        assert {e["staleness"] for e in log} == {0}


@pytest.mark.slow
def test_sync_run_killed_and_restarted_continues_as_if_uninterrupted(tmp_path, sync_runs):
    """2 servers, 2 workers, a checkpoint every 2 steps. A dead worker, then a dead server, are
    failures that torch elastic restarts every process for: the second worker (rank 3) is
    SIGKILLed after step 3, and in the restarted attempt the second server (rank 1) while it
    writes its shard of the step-4 checkpoint, which stays incomplete. Each time the servers load
    their shards, optimizer state and version from the step-2 checkpoint, the workers their
    step, data position and RNG."""
    straight, run = sync_runs(2), tmp_path / "killed"
    run_training(
        run,
        [*sync_overrides(2), "launcher.max_restarts=2"],
        plugins=[inhouse.KillAt(step=3, rank=3), inhouse.KillServerAt(step=4, rank=1)],
    )
    assert (run / "server_killed").exists()
    logged = read_metrics(run)
    assert logged[-1]["restarts"] == 2
    # steps may be logged twice (before a kill and after the restart): the last one wins
    resumed = {m["step"]: (m["loss"], m["grad_norm"]) for m in logged}
    expected = {m["step"]: (m["loss"], m["grad_norm"]) for m in read_metrics(straight)}
    assert resumed == expected  # exactly: the same state, data and summation order
    for s in range(2):  # each server's log continues from the checkpoint's, version by version
        assert [e["version"] for e in server_log(run, s) if e["worker"] == 2] == [1, 2, 3, 4, 5]
        final = [
            torch.load(r / "checkpoints" / "step_00000005" / f"ps_server{s}.pt", weights_only=True)
            for r in (straight, run)
        ]
        assert all(torch.equal(a, b) for a, b in zip(final[0]["params"], final[1]["params"]))
        assert final[0]["version"] == final[1]["version"] == 5


@pytest.mark.slow
def test_sync_servers_end_with_the_workers_at_train_stop_at(tmp_path, sync_runs):
    """One round of population-based training: ``train.stop_at=2`` ends the job after step 2,
    servers included (they counted train.steps rounds and waited for pushes that never came),
    and the same command without it resumes to step 5 exactly as the uninterrupted run."""
    run = tmp_path / "rounds"
    run_training(run, [*sync_overrides(1), "train.stop_at=2"])
    assert [m["step"] for m in read_metrics(run)] == [1, 2]
    run_training(run, sync_overrides(1))
    assert losses_and_norms(run) == losses_and_norms(sync_runs(1))


# ---------------------------------------------------------------------------------------------
# async parameter servers with a straggler
# ---------------------------------------------------------------------------------------------

MAX_STALENESS = 1


@pytest.fixture(scope="module")
def async_run(tmp_path_factory):
    """1 server, a fast worker (rank 1, the logging rank) and a slow one (rank 2, 0.8 s before
    every forward pass: many times the fast worker's step on this model)."""
    run = tmp_path_factory.mktemp("async") / "r"
    run_training(
        run,
        [
            "train.steps=12",
            "strategy=parameter_server",
            "strategy.mode=async",
            f"strategy.max_staleness={MAX_STALENESS}",
            "launcher.nproc_per_node=3",
        ],
        plugins=[SlowRank(rank=2, seconds=0.8)],
    )
    log = [json.loads(line) for line in (run / "ps_server0.jsonl").read_text().splitlines()]
    return run, log


@pytest.mark.alone
@pytest.mark.slow
def test_async_fast_worker_is_not_held_back_by_the_slow_one(async_run):
    _, log = async_run
    fast_done = max(e["t"] for e in log if e["worker"] == 1)
    slow_pushes_meanwhile = sum(1 for e in log if e["worker"] == 2 and e["t"] <= fast_done)
    assert sum(1 for e in log if e["worker"] == 1) == 12
    assert slow_pushes_meanwhile <= 6  # while the fast worker pushed 12, the slow one at most 6


@pytest.mark.alone
@pytest.mark.slow
def test_async_servers_apply_no_update_older_than_the_bound(async_run):
    _, log = async_run
    applied = [e for e in log if e["applied"]]
    assert max(e["staleness"] for e in applied) <= MAX_STALENESS
    assert any(not e["applied"] for e in log)  # the straggler's stale gradients were dropped
    assert len(applied) == log[-1]["version"]


@pytest.mark.alone
@pytest.mark.slow
def test_async_training_learns_and_reports_its_figures(async_run):
    run, _ = async_run
    metrics = read_metrics(run)
    assert metrics[-1]["loss"] < metrics[0]["loss"] - 0.3
    last = metrics[-1]
    assert last["ps/worker1/steps"] == 12 and last["ps/worker2/steps"] < 12
    # reported (when the fast worker logs its last step, the straggler's stale pushes may still
    # be on their way: the drops themselves are proven from the servers' log above)
    assert last["ps/server0/busy_fraction"] > 0 and "ps/server0/dropped" in last
    assert (
        sum(v for k, v in last.items() if k.startswith("ps/staleness/"))
        == last["ps/server0/version"]
    )


ASYNC_STEPS = 8


@pytest.mark.slow
def test_async_job_goes_on_without_a_dead_worker(tmp_path):
    """``plait train`` (the CLI), the async run above without the straggler and with fewer
    steps; the second worker (rank 2) SIGKILLs itself after its step 3. torch elastic's agent
    would end every rank; plait's lets the job go on: the server notices the loss (the dead
    worker's goodbye fails), stops waiting for it, and the first worker finishes its steps.
    The survivor waits after its step 4 until the server has published the loss: otherwise on
    a slow machine it may log its last step before the server read the failed goodbye."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "plait",
            "train",
            *TEST_OVERRIDES,
            f"run.root={tmp_path}",
            "run.name=r",
            f"train.steps={ASYNC_STEPS}",
            "strategy=parameter_server",
            "strategy.mode=async",
            f"strategy.max_staleness={MAX_STALENESS}",
            "launcher.nproc_per_node=3",
            "+plugins=[inhouse:kill_rank2_at_3,inhouse:await_rank2_lost_at_4]",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=500,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "plait: rank 2 died (SIGKILL); the strategy lets the job go on without it" in done.stderr
    assert "parameter server 0: worker rank 2 lost" in done.stderr
    log = server_log(tmp_path / "r", 0)
    [left] = [e for e in log if "left" in e]
    assert left["worker"] == 2 and left["alive"] == 1
    pushes = [e for e in log if "left" not in e]
    # the dead worker's 3 pushes were served before its death was noticed, none after
    assert [e["t"] < left["t"] for e in pushes if e["worker"] == 2] == [True] * 3
    survivor = [e for e in pushes if e["worker"] == 1]
    assert len(survivor) == ASYNC_STEPS  # the survivor's every step,
    assert sum(e["t"] > left["t"] for e in survivor) >= ASYNC_STEPS - 4  # 5 to 8 after the loss
    metrics = read_metrics(tmp_path / "r")
    assert metrics[-1]["step"] == ASYNC_STEPS
    assert [m["ps/server0/workers_alive"] for m in metrics if m["step"] > 4] == [1] * 4
    assert metrics[-1]["loss"] < metrics[0]["loss"] - 0.3
    assert (tmp_path / "r" / "checkpoints" / f"step_{ASYNC_STEPS:08d}" / "complete.json").exists()


# ---------------------------------------------------------------------------------------------
# local SGD and DiLoCo
# ---------------------------------------------------------------------------------------------

SGD = ("optimizer=sgd", "train.grad_clip=0")  # no clipping: each replica would clip its own


@pytest.mark.slow
def test_local_sgd_and_diloco_with_h1_equal_ddp(tmp_path):
    reference = tmp_path / "one"
    run_training(reference, [*STEPS, *ONE, *SGD])  # = DDP on 2 processes (tests/test_ddp.py)
    expected = [m["loss"] for m in read_metrics(reference)]
    for name, extra in [
        ("local_sgd", ()),
        ("diloco", ("strategy.outer_lr=1", "strategy.outer_momentum=0")),
    ]:
        run_training(
            tmp_path / name,
            [*STEPS, *TWO, *SGD, f"strategy={name}", "strategy.sync_every=1", *extra],
        )
        assert [m["loss"] for m in read_metrics(tmp_path / name)] == pytest.approx(
            expected, rel=REL
        ), name


def replicas(run: Path, step: int) -> list[dict[str, torch.Tensor]]:
    return [
        torch.load(
            run / "checkpoints" / f"step_{step:08d}" / f"replica_dp{r}.pt", weights_only=True
        )["model"]
        for r in (0, 1)
    ]


def identical(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


def replica_overrides(name: str) -> list[str]:
    extra = ("strategy.outer_lr=0.7", "strategy.outer_momentum=0.9")[: 2 * (name == "diloco")]
    return [
        "train.steps=6",
        *TWO,
        f"strategy={name}",
        "strategy.sync_every=3",
        *extra,
        "checkpoint.keep_last=0",
    ]


@pytest.fixture(scope="module")
def replica_runs(tmp_path_factory):
    """Uninterrupted local SGD / DiLoCo runs (AdamW inside, H=3, a checkpoint every step), made
    once per module when first asked."""
    runs = {}

    def run(name: str) -> Path:
        if name not in runs:
            runs[name] = tmp_path_factory.mktemp(name) / "r"
            run_training(runs[name], [*replica_overrides(name), "checkpoint.every=1"])
        return runs[name]

    return run


@pytest.mark.slow
@pytest.mark.parametrize("name", ["local_sgd", "diloco"])
def test_replicas_meet_every_h_steps_and_learn_with_adamw(replica_runs, name):
    run = replica_runs(name)
    for step in range(1, 7):
        assert identical(*replicas(run, step)) == (step % 3 == 0), step
    metrics = read_metrics(run)
    assert metrics[-1]["loss"] < metrics[0]["loss"] - 0.3


@pytest.mark.slow
@pytest.mark.parametrize("name", ["local_sgd", "diloco"])
def test_replicas_resume_diverged_as_if_uninterrupted(tmp_path, replica_runs, name):
    """The step-4 checkpoint holds replicas that differ (H=3); rank 1 is SIGKILLed after step 5,
    torch elastic restarts both, each replica resumes from its own file. DiLoCo's files also
    hold the outer parameters and the outer Nesterov momentum of step 3's outer step, which
    step 6's outer step needs."""
    straight, run = replica_runs(name), tmp_path / "killed"
    run_training(
        run,
        [*replica_overrides(name), "checkpoint.every=2", "launcher.max_restarts=1"],
        plugins=[inhouse.KillAt(step=5, rank=1)],
    )
    assert not identical(*replicas(run, 4))
    logged = read_metrics(run)
    assert logged[-1]["restarts"] == 1
    resumed = {m["step"]: m["loss"] for m in logged}  # step 5 may be logged twice: last wins
    assert resumed == {m["step"]: m["loss"] for m in read_metrics(straight)}
    assert all(identical(a, b) for a, b in zip(replicas(straight, 6), replicas(run, 6)))


def _diloco_two_parameters(rank: int, world_size: int, config: dict, out: str) -> None:
    """DiLoCo's engine on ``y = w·x + b`` (2 parameters), inner SGD at lr 0.1 on a squared error,
    each rank its own samples (``sample``); rank 0 writes every replica's (w, b) after each
    step."""
    import torch.distributed as dist
    from omegaconf import OmegaConf

    from plait.plugins.diloco.outer import DiLoCoEngine
    from plait.topology import Topology

    cfg = OmegaConf.create(config)
    topology = Topology.initialize(cfg)
    model = torch.nn.Linear(1, 1)
    with torch.no_grad():
        model.weight.fill_(W0)
        model.bias.fill_(B0)
    engine = DiLoCoEngine(
        cfg,
        model,
        torch.optim.SGD(model.parameters(), lr=INNER_LR),
        torch.nn.functional.mse_loss,
        topology,
    )
    after = []
    for step in range(1, 5):
        x, y = sample(rank, step)
        engine.train_step([(torch.tensor([[x]]), torch.tensor([[y]]))], lr=INNER_LR)
        mine = torch.tensor([model.weight.item(), model.bias.item()], dtype=torch.float64)
        every = [torch.empty_like(mine) for _ in range(world_size)]
        dist.all_gather(every, mine)
        after.append([t.tolist() for t in every])
    if rank == 0:
        Path(out).write_text(json.dumps(after))


W0, B0, INNER_LR = 0.5, -0.25, 0.1


def sample(rank: int, step: int) -> tuple[float, float]:
    return 0.5 + 0.5 * rank + 0.1 * step, 1.0 - 2.0 * rank


@pytest.mark.slow
def test_diloco_outer_step_is_nesterov_at_the_papers_defaults(tmp_path):
    """Two outer steps (H=2) at the paper's defaults (outer lr 0.7, Nesterov momentum 0.9),
    against the same steps computed here by hand: with the momentum of the first outer step
    carried into the second. Local SGD (outer lr 1, no momentum) would give the replicas'
    mean instead, which differs."""
    from omegaconf import OmegaConf

    from plait.testing import compose

    cfg = compose(
        [
            "strategy=diloco",
            "strategy.sync_every=2",
            "launcher.nproc_per_node=2",
            "optimizer=sgd",
            "train.grad_clip=0",
        ]
    )
    assert (cfg.strategy.outer_lr, cfg.strategy.outer_momentum) == (0.7, 0.9)  # the defaults
    spawn(
        _diloco_two_parameters,
        2,
        OmegaConf.to_container(cfg, resolve=True),
        str(tmp_path / "after.json"),
    )

    lr, momentum = 0.7, 0.9
    theta, buf = [W0, B0], None  # the outer parameters and the outer momentum buffer
    replicas, expected, means = [theta, theta], [], []
    for step in range(1, 5):
        for r in (0, 1):  # one inner SGD step: d/dw (wx+b-y)^2 = 2(wx+b-y)x, d/db = 2(wx+b-y)
            (w, b), (x, y) = replicas[r], sample(r, step)
            e = w * x + b - y
            replicas[r] = [w - INNER_LR * 2 * e * x, b - INNER_LR * 2 * e]
        if step % 2 == 0:  # the outer step on the pseudo-gradient
            mean = [(a + c) / 2 for a, c in zip(*replicas)]
            delta = [t - m for t, m in zip(theta, mean)]
            buf = delta if buf is None else [momentum * u + d for u, d in zip(buf, delta)]
            theta = [t - lr * (d + momentum * u) for t, d, u in zip(theta, delta, buf)]
            replicas = [theta, theta]
            means.append(mean)
        expected.append([list(r) for r in replicas])
    after = json.loads((tmp_path / "after.json").read_text())
    for step, (got, want) in enumerate(zip(after, expected), start=1):
        assert got == [pytest.approx(w, rel=1e-5, abs=1e-6) for w in want], step
    for mean, outer in zip(means, (expected[1][0], expected[3][0])):  # not local SGD's mean
        assert all(abs(m - o) > 1e-2 for m, o in zip(mean, outer)), (mean, outer)


def _replicas_by_node(rank: int, world_size: int, configs: list[dict], out: str) -> None:
    """4 processes posing as 2 nodes x 2: local SGD, each replica on its own data; for each
    config, rank 0 records after every step whether the replicas are equal inside each node and
    across the nodes."""
    import torch.distributed as dist
    from omegaconf import OmegaConf

    from plait.plugins.local_sgd.engine import LocalSGDEngine
    from plait.topology import Topology

    schedules = []
    for config in configs:
        cfg = OmegaConf.create(config)
        topology = Topology.initialize(cfg)
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        engine = LocalSGDEngine(
            cfg,
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            torch.nn.functional.mse_loss,
            topology,
        )
        data = torch.Generator().manual_seed(rank)
        schedule = []
        for _ in range(8):
            engine.train_step(
                [(torch.randn(8, 4, generator=data), torch.randn(8, 1, generator=data))], lr=0.1
            )
            mine = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            every = [torch.empty_like(mine) for _ in range(world_size)]
            dist.all_gather(every, mine)
            schedule.append(
                [
                    torch.equal(every[0], every[1]) and torch.equal(every[2], every[3]),
                    torch.equal(every[0], every[2]),
                ]
            )
        schedules.append(schedule)
    if rank == 0:
        Path(out).write_text(json.dumps(schedules))


@pytest.mark.slow
def test_hierarchical_local_sgd_averages_in_the_node_every_k_and_across_nodes_every_h(tmp_path):
    """H=4 with ``strategy.node_sync_every=1``: replicas equal inside each node after every step,
    across nodes only after steps 4 and 8; with K=2, inside the nodes after even steps."""
    from omegaconf import OmegaConf

    from plait.testing import compose

    configs = [
        OmegaConf.to_container(
            compose(
                [
                    "strategy=local_sgd",
                    "strategy.sync_every=4",
                    f"strategy.node_sync_every={k}",
                    "launcher.nproc_per_node=4",
                    "optimizer=sgd",
                    "train.grad_clip=0",
                ]
            ),
            resolve=True,
        )
        for k in (1, 2)
    ]
    spawn(_replicas_by_node, 4, configs, str(tmp_path / "schedules.json"), nproc_per_node=2)
    across = [step % 4 == 0 for step in range(1, 9)]
    expected = [
        [[a or b, b] for a, b in zip(in_node, across)]
        for in_node in ([True] * 8, [False, True] * 4)
    ]
    assert json.loads((tmp_path / "schedules.json").read_text()) == expected


def test_node_sync_every_must_be_below_sync_every():
    assert "strategy.node_sync_every=4 must be below strategy.sync_every=4" in problems(
        "strategy=local_sgd", "strategy.sync_every=4", "strategy.node_sync_every=4"
    )
    assert "strategy.node_sync_every=-1 is out of range" in problems(
        "strategy=local_sgd", "strategy.node_sync_every=-1"
    )
