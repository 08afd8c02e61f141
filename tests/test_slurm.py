"""A real SLURM on this machine: Debian's slurm-wlm and munge, one controller and one node daemon
on localhost, started by the fixture (installed by scripts/test.sh where root and apt-get are
available, never by a test; skipped, with the reason, where they are absent or cannot run).
``plait train launcher=slurm`` submits through Hydra's submitit launcher; ``plait train`` in the
batch step of an sbatch script starts its own workers."""

from __future__ import annotations

import subprocess
import sys

import pytest
from slurm_cluster import final_state

from plait.testing import TEST_OVERRIDES, read_metrics, run_losses

pytestmark = pytest.mark.slow

STEPS = ["train.steps=3", "optimizer.decay_steps=3"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Losses of the same run started locally with 2 worker processes."""
    return run_losses(
        tmp_path_factory.mktemp("ref") / "local", [*STEPS, "launcher.nproc_per_node=2"]
    )


def test_launcher_slurm_submits_and_each_task_joins_the_job(slurm, reference, tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "plait",
        "train",
        "launcher=slurm",
        "launcher.tasks_per_node=2",
        "launcher.time=10",
        *TEST_OVERRIDES,
        *STEPS,
        f"run.root={tmp_path}",
        "run.name=sub",
    ]
    done = subprocess.run(cmd, env=slurm, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # one SLURM job (submitit's folder is named by its id) that completed
    [job_dir] = [p for p in (tmp_path / "sub" / ".submitit").iterdir() if p.is_dir()]
    assert final_state(slurm, job_dir.name) == "COMPLETED"
    # its two tasks were the two ranks of one torch job: the losses of the local 2-process run
    losses = [m["loss"] for m in read_metrics(tmp_path / "sub" / "0")]
    assert losses == pytest.approx(reference, rel=1e-6)


def test_plait_in_an_sbatch_batch_step_starts_its_own_workers(slurm, reference, tmp_path):
    # The batch step has SLURM_PROCID=0 and SLURM_NTASKS=2 but is one process: taking it for a
    # task of srun would wait for a second rank that never comes.
    train = " ".join(
        [
            sys.executable,
            "-m",
            "plait",
            "train",
            "launcher.nproc_per_node=2",
            *TEST_OVERRIDES,
            *STEPS,
            f"run.root={tmp_path}",
            "run.name=batch",
        ]
    )
    done = subprocess.run(
        ["sbatch", "--parsable", "--ntasks=2", f"--output={tmp_path}/batch.out", f"--wrap={train}"],
        env=slurm,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    state = final_state(slurm, done.stdout.strip().split(";")[0], timeout=600)
    output = (tmp_path / "batch.out").read_text() if (tmp_path / "batch.out").exists() else ""
    assert state == "COMPLETED", state + output[-3000:]
    losses = [m["loss"] for m in read_metrics(tmp_path / "batch")]
    assert losses == pytest.approx(reference, rel=1e-6)


def test_fault_torchft_runs_its_replica_groups_and_lighthouse_in_the_allocation(
    slurm, reference, tmp_path
):
    """``launcher=slurm fault=torchft``: the two tasks are two replica groups of one task each,
    torch jobs of their own; task 0 runs the lighthouse; every step's quorum holds both, and the
    losses are the local 2-process run's."""
    cmd = [
        sys.executable,
        "-m",
        "plait",
        "train",
        "launcher=slurm",
        "launcher.tasks_per_node=2",
        "launcher.time=10",
        "fault=torchft",
        "fault.min_replicas=2",  # both in the first quorum
        *TEST_OVERRIDES,
        *STEPS,
        f"run.root={tmp_path}",
        "run.name=ft",
    ]
    done = subprocess.run(cmd, env=slurm, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    metrics = read_metrics(tmp_path / "ft" / "0")
    assert [m["quorum/participants"] for m in metrics] == [2.0] * len(reference)
    assert [m["loss"] for m in metrics] == pytest.approx(reference, rel=1e-5)
    other = (tmp_path / "ft" / "0" / "replica_groups" / "1" / "metrics.jsonl").read_text()
    assert len(other.splitlines()) == len(reference)
