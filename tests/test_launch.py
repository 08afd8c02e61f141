"""Starting workers: under torchrun, and under a SLURM-style launcher (environment only)."""

import os
import subprocess
import sys

import pytest

from plait.plugins.launch import torch_env_from_slurm
from plait.testing import TEST_OVERRIDES, free_port, read_metrics, run_losses

pytestmark = pytest.mark.slow

STEPS = ["train.steps=3", "optimizer.decay_steps=3"]


def test_torchrun_runs_plait_in_place_with_the_same_losses(tmp_path):
    reference = run_losses(tmp_path / "ref", [*STEPS, "launcher.nproc_per_node=2"])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           f"--master_port={free_port()}", "-m", "plait", "train", *TEST_OVERRIDES, *STEPS,
           f"run.root={tmp_path}", "run.name=torchrun"]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    losses = [m["loss"] for m in read_metrics(tmp_path / "torchrun")]
    assert losses == pytest.approx(reference, rel=1e-6)
    # one config written (by rank 0) and no per-worker Hydra output directories
    assert sorted(p.name for p in (tmp_path / "torchrun").iterdir()) == [
        "checkpoints", "config.yaml", "metrics.jsonl"]
    assert not list(tmp_path.glob("**/.hydra"))


def test_srun_environment_is_translated_for_torch(tmp_path):
    # A stand-in for srun (no SLURM here): start 2 processes with the variables srun sets.
    port = free_port()
    procs = []
    for rank in range(2):
        env = {k: v for k, v in os.environ.items()
               if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
        env.update(SLURM_PROCID=str(rank), SLURM_NTASKS="2", SLURM_LOCALID=str(rank),
                   SLURM_TASKS_PER_NODE="2",
                   SLURM_NODEID="0", SLURM_JOB_ID="4242", SLURM_LAUNCH_NODE_IPADDR="127.0.0.1",
                   MASTER_PORT=str(port))
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "plait", "train", *TEST_OVERRIDES, *STEPS,
             f"run.root={tmp_path}"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out.decode()[-2000:]
    # both ranks agreed on the run directory through the job id
    assert len(read_metrics(tmp_path / "job-4242")) == 3


def test_slurm_variables_map_to_torch_env():
    env = torch_env_from_slurm({"SLURM_PROCID": "4", "SLURM_NTASKS": "7", "SLURM_LOCALID": "1",
                                "SLURM_TASKS_PER_NODE": "3,2(x2)", "SLURM_NODEID": "1",
                                "SLURM_LAUNCH_NODE_IPADDR": "10.0.0.1"}, master_port=0)
    assert env == {"RANK": "4", "WORLD_SIZE": "7", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                   "GROUP_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    assert torch_env_from_slurm({"RANK": "0", "SLURM_PROCID": "0"}, 0) == {}
