"""Elastic scaling grows when a node joins and shrinks when one is lost: a job of two "nodes" on
this host, each a torch elastic agent of its own with its own loopback address (127.0.0.1 and
127.0.0.2, ``launcher.local_addr``) and its own session, meeting at a c10d rendezvous on
127.0.0.1, started with ``launcher.nnodes=1:2`` under ZeRO-1. It needs no root and no network
namespaces, so it runs wherever the suite runs: what elasticity needs of a node (an agent that
joins a rendezvous, and whose loss, agent and workers at once, the other agent notices by its
missed heartbeats) is all there; separate network stacks would add nothing to prove here (the
multi-node training itself across namespaces: tests/test_multinode.py,
tests/test_comm_multinode.py). Node 0 starts alone (world 2, dp 2, accumulating 2
micro-batches) and checkpoints at step 2; node 1 then starts, node 0's agent sees it waiting and
re-forms the group at world 4 (dp 4, accumulation 1) from that checkpoint (resharded dp 2 -> 4);
after the step-4 checkpoint every process of node 1 is lost, node 0's agent spends its restart,
meets alone and finishes at world 2 (dp 4 -> 2). The global batch stays 8 sequences throughout.

The reference is one process that accumulates the same 4 micro-batches of 2 sequences per step:
the same global batch, never interrupted. Tolerance: fp32 losses within rel 1e-5 (the runs sum
the same micro-batch gradients in another order). Fast tests: the range handed to torch elastic,
and the accumulation at each size; the refusals are in tests/test_refusals.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import inhouse
import pytest

from plait.plugins.launch import launch_config
from plait.testing import (
    TEST_OVERRIDES,
    compose,
    free_port,
    read_metrics,
    read_wandb_run,
    run_training,
)
from plait.topology import ParallelDims, elastic_grad_accum_steps

ELASTIC = ["launcher.master_port=29500", "launcher.max_restarts=1", "run.name=r"]

# node 1 joins after step 2's checkpoint and is lost after step 4's
STEPS, JOINED_AFTER, LOST_AFTER = 8, 2, 4
RUN = [
    *TEST_OVERRIDES,
    f"train.steps={STEPS}",
    f"optimizer.decay_steps={STEPS}",
    "precision=fp32",
    f"checkpoint.every={JOINED_AFTER}",
    "checkpoint.keep_last=0",
]
# torch's rendezvous timings, shortened: a lost node is declared dead after 3 missed 2-second
# heartbeats; a round with fewer than 2 nodes closes 5 s after it reached 1 (both nodes start
# well within that).
RDZV = "launcher.rdzv_conf={last_call_timeout:5,keep_alive_interval:2,keep_alive_max_attempt:3}"


def test_nnodes_min_max_hands_torch_elastic_the_range_and_the_rendezvous_settings(tmp_path):
    cfg = compose(["launcher.nnodes=1:2", *ELASTIC, "launcher.rdzv_conf={last_call_timeout:10}"])
    config = launch_config(cfg, ParallelDims.from_config(cfg, world_size=4), str(tmp_path))
    assert (config.min_nodes, config.max_nodes) == (1, 2)
    assert config.rdzv_backend == "c10d" and config.max_restarts == 1
    assert {k: config.rdzv_configs[k] for k in ("last_call_timeout", "is_host")} == {
        "last_call_timeout": 10,
        "is_host": True,
    }
    fixed_cfg = compose(["launcher.nnodes=2", *ELASTIC])
    fixed = launch_config(
        fixed_cfg, ParallelDims.from_config(fixed_cfg, world_size=4), str(tmp_path)
    )
    assert (fixed.min_nodes, fixed.max_nodes) == (2, 2)


def test_accumulation_grows_as_dp_shrinks_so_the_global_batch_is_kept():
    """2 to 4 nodes of 2 processes, the settings given for 4 nodes: 48 sequences = 2 per
    micro-batch x 3 accumulated x dp 8. At 3 nodes dp 6 accumulates 4, at 2 nodes dp 4 6."""
    cfg = compose(
        [
            "launcher.nnodes=2:4",
            "launcher.nproc_per_node=2",
            "train.batch_size=48",
            "train.grad_accum_steps=3",
            *ELASTIC,
        ]
    )
    at = {
        n: elastic_grad_accum_steps(cfg, ParallelDims.from_config(cfg, world_size=2 * n), 2)
        for n in (2, 3, 4)
    }
    assert at == {2: 6, 3: 4, 4: 3}
    assert {n: 2 * steps * 2 * n for n, steps in at.items()} == {2: 48, 3: 48, 4: 48}
    fixed = compose(
        [
            "launcher.nnodes=4",
            "launcher.nproc_per_node=2",
            "train.batch_size=48",
            "train.grad_accum_steps=3",
            *ELASTIC,
        ]
    )
    assert elastic_grad_accum_steps(fixed, ParallelDims.from_config(fixed, world_size=4), 2) == 3


def steps_of_all_ranks(rows: Path, ranks: range, attempt: int) -> list[list[str]]:
    """Each step's input rows of all ``ranks`` together in one attempt (a rank's ``attempt``-th
    file), sorted: the global batch."""
    per_rank = [inhouse.recorded_steps(rows, r)[attempt] for r in ranks]
    return [sorted(sum(step, [])) for step in zip(*per_rank)]


@pytest.mark.slow
def test_a_joining_node_grows_and_a_lost_node_shrinks_the_job_which_keeps_the_global_batch(
    tmp_path,
):
    reference = tmp_path / "one_process"
    run_training(
        reference,
        [*RUN, "launcher.nproc_per_node=1", "train.grad_accum_steps=4"],
        [inhouse.RecordBatches(tmp_path / "rows_reference")],
    )
    want_losses = [m["loss"] for m in read_metrics(reference)]
    want_rows = steps_of_all_ranks(tmp_path / "rows_reference", range(1), 0)

    run_dir = tmp_path / "elastic"
    port = free_port()
    overrides = [
        *RUN,
        RDZV,
        "strategy=zero1",
        "launcher.max_restarts=1",
        f"run.root={tmp_path}",
        "run.name=elastic",
        "tracker=wandb",
        "launcher.nnodes=1:2",
        "launcher.nproc_per_node=2",
        "launcher.master_addr=127.0.0.1",
        f"launcher.master_port={port}",
        "+plugins=[inhouse:record_rows,inhouse:hold_alone_after_step_2,"
        "inhouse:hold_node1_after_step_4]",
    ]
    env = {
        **os.environ,
        "PYTHONPATH": f"{Path(__file__).parent}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    logs, procs = {}, {}

    def start(node: int) -> None:
        """Node ``node``'s agent at 127.0.0.<node+1>, in a session of its own (its agent and
        workers are one process group, which a node's death kills whole)."""
        logs[node] = tmp_path / f"node{node}.log"
        command = [
            sys.executable,
            "-m",
            "plait",
            "train",
            *overrides,
            f"launcher.node_rank={node}",
            f"launcher.local_addr=127.0.0.{node + 1}",
        ]
        with open(logs[node], "w") as log:
            procs[node] = subprocess.Popen(
                command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def wait_for(flag: str) -> None:
        deadline = time.monotonic() + 400
        while not (run_dir / flag).exists():
            assert all(p.poll() is None for p in procs.values()), logs_tail(logs)
            assert time.monotonic() < deadline, logs_tail(logs)
            time.sleep(0.5)

    try:
        start(0)  # alone: the round closes at MIN=1 after the last call
        wait_for("node0_alone_held")
        start(1)  # joins: node 0's agent re-forms the group with it
        wait_for("node1_held")
        os.killpg(procs[1].pid, signal.SIGKILL)  # the whole node: its agent and its workers
        procs[1].wait()
        try:
            code = procs[0].wait(timeout=400)
        except subprocess.TimeoutExpired:
            code = None
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    out = logs[0].read_text()
    assert code == 0, logs_tail(logs)

    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    # each re-formation, as every logged step records it, in metrics.jsonl and the same W&B run;
    # a node joining restarts the group without spending a restart (torch elastic's agent:
    # "membership changes do not count as retries"), the lost node spends node 0's one restart
    sizes = [
        (m["nodes"], m["world_size"], m["dp"], m["grad_accum_steps"], m["restarts"])
        for m in metrics
    ]
    assert sizes == (
        [(1, 2, 2, 2, 0)] * JOINED_AFTER
        + [(2, 4, 4, 1, 0)] * (LOST_AFTER - JOINED_AFTER)
        + [(1, 2, 2, 2, 1)] * (STEPS - LOST_AFTER)
    )
    wandb = read_wandb_run(run_dir)  # the newest offline run file: the last attempt's
    assert [
        (h["_step"], h["world_size"], h["dp"], h["grad_accum_steps"], h["restarts"])
        for h in wandb["history"]
    ] == [(step, 2, 2, 2, 1) for step in range(LOST_AFTER + 1, STEPS + 1)]
    assert all(p.name.endswith(wandb["id"]) for p in run_dir.glob("wandb/offline-run-*"))
    for nodes, world, dp, accumulation, step in [
        (2, 4, 4, 1, JOINED_AFTER),
        (1, 2, 2, 2, LOST_AFTER),
    ]:
        assert (
            f"plait: elastic group of {nodes} node(s) (launcher.nnodes=1:2): world size "
            f"{world}, dp {dp}, grad_accum_steps {accumulation}, train.batch_size 8 kept; "
            f"continuing at step {step}"
        ) in out
    assert out.count("plait: converting checkpoint") == 2  # dp 2 -> 4 -> 2, layout-free copy
    # each rank keeps its micro-batch of 2 sequences: 2 per step at dp 2, 1 per step at dp 4
    rows = run_dir / "rows"
    shapes = {
        (rank, attempt): {
            tuple(map(len, step)) for step in inhouse.recorded_micro_batches(rows, rank)[attempt]
        }
        for rank, attempt in [(0, 0), (0, 1), (3, 0), (0, -1), (1, -1)]
    }
    assert shapes == {
        (0, 0): {(2, 2)},
        (0, 1): {(2,)},
        (3, 0): {(2,)},
        (0, -1): {(2, 2)},
        (1, -1): {(2, 2)},
    }
    # the global batch: the same 8 sequences per step at every size
    assert steps_of_all_ranks(rows, range(2), 0) == want_rows[:JOINED_AFTER]
    grown = [inhouse.recorded_steps(rows, r)[1 if r < 2 else 0] for r in range(4)]  # node 1: 1st
    assert [sorted(sum(step, [])) for step in zip(*grown)] == want_rows[JOINED_AFTER:LOST_AFTER]
    assert steps_of_all_ranks(rows, range(2), -1) == want_rows[LOST_AFTER:]
    assert [m["loss"] for m in metrics] == pytest.approx(want_losses, rel=1e-5)


def logs_tail(logs: dict[int, Path]) -> str:
    return "\n".join(
        f"--- node {rank}\n{path.read_text()[-3000:]}"
        for rank, path in logs.items()
        if path.exists()
    )
