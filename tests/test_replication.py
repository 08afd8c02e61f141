"""Replication (``checkpoint.local_dir``, ``checkpoint.replicas``): a 2-node job keeps each node's part of a
checkpoint on the other node too; node 1 is SIGKILLed, agent and worker, its checkpoint
directory deleted, and the re-run of the same commands (a SLURM requeue) resumes from node 0's
replica with the uninterrupted losses and final weights.

The two "nodes" are two torch elastic agents on this host (``plait train launcher.nnodes=2
launcher.node_rank=k``, one worker each), meeting at a c10d rendezvous on 127.0.0.1. A fair
stand-in for two machines here: a node reads and writes only its own root
(``<checkpoint.local_dir>/<run>/node<k>``), so deleting node 1's root is losing its disk, and every
byte of a replica travels between the nodes' processes over torch.distributed (gloo over TCP),
as between machines. Network namespaces would add separate addresses, not separate disks (they
share the file system), so they would prove nothing more here and cost a second set-up.
"""

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from plait.plan import format_plan, make_plan
from plait.plugins.checkpoint import replication
from plait.testing import TEST_OVERRIDES, free_port, read_metrics

STEPS = 6
RUN = [
    f"train.steps={STEPS}",
    "optimizer.decay_steps=6",
    "checkpoint.every=3",
    "launcher.nnodes=2",
    "launcher.nproc_per_node=1",
    "launcher.master_addr=127.0.0.1",
    "launcher.local_addr=127.0.0.1",
    "launcher.timeout_s=120",
    "checkpoint.replicas=1",
]
STEP3, STEP6 = "step_00000003", "step_00000006"


def part(*nodes: int, nnodes: int = 2) -> dict:
    return {n: {"nnodes": nnodes, "files": {f"rng_rank{n}.pt": 10}} for n in nodes}


def test_the_newest_checkpoint_whose_parts_survive_is_restored_from_the_replicas():
    # 2 nodes, 1 replica: node 1's disk is lost; node 0 holds both parts of both checkpoints
    held = {0: {STEP3: part(0, 1), STEP6: part(0, 1)}, 1: {}}
    plan = replication.plan_restore(held, nnodes=2, replicas=1)
    assert (plan.name, plan.fetches, plan.lost_newer) == (STEP6, [(1, 0, 0), (1, 1, 0)], [])
    # 3 nodes, ring replicas (node k's part also on node k+1): node 2 lost; each node ends up
    # holding every part, node 2's own from node 0's replica
    held = {0: {STEP6: part(0, 2, nnodes=3)}, 1: {STEP6: part(1, 0, nnodes=3)}}
    plan = replication.plan_restore(held, nnodes=3, replicas=1)
    assert plan.fetches == [(0, 1, 1), (1, 2, 0), (2, 0, 0), (2, 1, 1), (2, 2, 0)]
    # the newest checkpoint has a part lost: the older whole one is used, and said so
    held = {0: {STEP3: part(0, 1), STEP6: part(0)}, 1: {STEP3: part(1, 0)}}
    plan = replication.plan_restore(held, nnodes=2, replicas=1)
    assert plan.name == STEP3
    assert plan.lost_newer == [
        f"node 1's part of checkpoint {STEP6} is lost: no node holds it "
        "or a replica of it (checkpoint.replicas=1; a node's part survives "
        "the loss of its disk only with checkpoint.replicas >= 1)"
    ]
    assert replication.plan_restore({0: {}, 1: {}}, nnodes=2, replicas=0) is None


def test_without_replicas_a_lost_disk_is_named_not_resumed_around():
    held = {0: {STEP3: part(0)}, 1: {}}
    with pytest.raises(
        replication.PartLost,
        match=f"node 1's part of checkpoint {STEP3} is lost: "
        r"no node holds it or a replica of it \(checkpoint.replicas=0",
    ):
        replication.plan_restore(held, nnodes=2, replicas=0)


def test_plan_says_where_each_nodes_part_and_its_replicas_live(tmp_path):
    plan = make_plan(
        [
            *TEST_OVERRIDES,
            *RUN,
            "launcher.master_port=29500",
            "run.name=r",
            f"run.root={tmp_path}",
            f"checkpoint.local_dir={tmp_path}/local",
        ]
    )
    assert plan.problems == []
    text = format_plan(plan)
    assert f"each node's own directory: {tmp_path}/local/r/node<k>" in text
    assert "node 0's part: node 0, replica on node 1" in text
    assert "node 1's part: node 1, replica on node 0" in text


def start_nodes(root: Path, name: str, extra: list[str]) -> list[subprocess.Popen]:
    """Both nodes' ``plait train``, each in a session of its own (its agent and worker form
    one process group, which a node's death kills whole)."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}
    return [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "plait",
                "train",
                *TEST_OVERRIDES,
                *RUN,
                *extra,
                f"run.root={root}",
                f"run.name={name}",
                f"checkpoint.local_dir={root}/local",
                f"launcher.master_port={port}",
                f"launcher.node_rank={node}",
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for node in (0, 1)
    ]


def finish(procs: list[subprocess.Popen]) -> list[tuple[int, str]]:
    done = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=400)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        done.append((proc.returncode, out))
    return done


def final_weights(root: Path, name: str) -> dict[str, torch.Tensor]:
    """Model and optimizer tensors of the final checkpoint, from node 0's own disk."""
    state = torch.load(
        root / "local" / name / "node0" / STEP6 / "model_pp0_tp0.pt", weights_only=True
    )
    flat = {f"model/{k}": v for k, v in state["model"].items()}
    for index, entries in state["optimizer"]["state"].items():
        flat |= {f"optim/{index}/{k}": v for k, v in entries.items()}
    return flat


@pytest.mark.slow
def test_a_lost_node_and_its_disk_resume_from_the_replica_with_the_same_losses(tmp_path):
    straight = finish(start_nodes(tmp_path, "straight", []))
    assert [code for code, _ in straight] == [0, 0], straight[0][1][-3000:] + straight[1][1][-3000:]

    killed = finish(start_nodes(tmp_path, "lost", ["+plugins=[inhouse:kill_node1_at_3]"]))
    assert (tmp_path / "lost" / "killed").exists(), "node 1 was never killed"
    assert killed[1][0] == -signal.SIGKILL, killed[1][1][-3000:]  # the agent died too
    assert killed[0][0] != 0  # node 0 cannot go on without node 1
    shutil.rmtree(tmp_path / "local" / "lost" / "node1")  # node 1's disk is gone

    again = finish(start_nodes(tmp_path, "lost", ["+plugins=[inhouse:kill_node1_at_3]"]))
    assert [code for code, _ in again] == [0, 0], again[0][1][-3000:] + again[1][1][-3000:]
    assert (
        f"plait: node 1: node 1's part of checkpoint {STEP3} restored from node 0's replica"
        in again[1][1]
    )
    assert f"resumed from {tmp_path}/local/lost/node0/{STEP3} at step 3" in again[0][1]
    metrics = read_metrics(tmp_path / "lost")
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert [m["loss"] for m in metrics] == [m["loss"] for m in read_metrics(tmp_path / "straight")]
    resumed, reference = final_weights(tmp_path, "lost"), final_weights(tmp_path, "straight")
    assert resumed.keys() == reference.keys()
    assert all(torch.equal(resumed[k], reference[k]) for k in reference)
    local = tmp_path / "local" / "straight"
    for node, peer in ((0, 1), (1, 0)):  # each node holds its own part and the other's replica
        parts = replication.parts_in(local / f"node{node}" / STEP6)
        assert sorted(parts) == [0, 1], f"node {node}"
        assert all((local / f"node{node}" / STEP6 / f).is_file() for f in parts[peer]["files"])
    assert "plait: node 1 sent its part of step_00000003" in straight[1][1]
