"""What the launcher tells a worker: which node it runs on and where (torch elastic's
variables), which replica group it belongs to (plait's launcher, for a job whose replica groups
run as independent torch jobs), and the rendezvous store of this restart."""

from __future__ import annotations

import os
import re
from datetime import timedelta
from typing import Mapping

import torch.distributed as dist

LAUNCHER_ENV = ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")
# Set by plait's launchers for each replica group's workers: ``<group> <groups>``.
REPLICA_GROUP_ENV = "PLAIT_REPLICA_GROUP"


def launcher_node_env(environ: dict[str, str]) -> tuple[int, int, int]:
    """``(node_rank, local_rank, local_world_size)`` as the launcher set them.

    torch elastic (``plait train``, ``torchrun``) sets all three; under ``srun`` plait's launcher
    derives them from ``SLURM_NODEID``, ``SLURM_LOCALID`` and ``SLURM_TASKS_PER_NODE``.
    """
    missing = [name for name in LAUNCHER_ENV if name not in environ]
    if missing:
        raise ValueError(
            f"{', '.join(missing)} not set: plait learns the nodes from the launcher; start the "
            "workers with `plait train`, `torchrun` or `srun ... plait train`"
        )
    return (
        int(environ["GROUP_RANK"]),
        int(environ["LOCAL_RANK"]),
        int(environ["LOCAL_WORLD_SIZE"]),
    )


def in_srun_task(environ: Mapping[str, str]) -> bool:
    """True in a task ``srun`` started (``SLURM_STEP_ID`` is set); False in the batch step of
    an ``sbatch`` script, which has ``SLURM_PROCID=0`` and ``SLURM_NTASKS`` of the whole job but
    is one process, not a task of a job step."""
    return "SLURM_PROCID" in environ and "SLURM_STEP_ID" in environ


def slurm_job_port(environ: Mapping[str, str], given: int = 0) -> int:
    """The port every task of a SLURM job agrees on: ``given`` (``launcher.master_port``), else
    derived from the job id, ``20000 + id % 40000``; plugins that need more ports take the next
    ones (``fault=torchft``: its lighthouse + 1, replica group ``g`` + 2 + g)."""
    job_id = int(re.sub(r"\D", "", environ.get("SLURM_JOB_ID", "0")) or 0)
    return given or 20000 + job_id % 40000


def first_host(nodelist: str) -> str:
    """The first host of a SLURM host list (``SLURM_JOB_NODELIST``), where its task 0 runs:
    ``gpu[003-004,010],cpu1`` -> ``gpu003``."""
    match = re.match(r"([^,\[]*)(?:\[([^\]]*)\](.*?))?(?:,|$)", nodelist)
    assert match is not None  # the pattern matches any string (each part may be empty)
    prefix, ranges, suffix = match.group(1), match.group(2), match.group(3) or ""
    if ranges is None:
        return prefix
    return prefix + re.split(r"[,-]", ranges)[0] + suffix


def replica_group_env(environ: dict[str, str]) -> tuple[int, int]:
    """``(group, groups)``: which of the job's replica groups this worker's torch job is, and how
    many there are (``PLAIT_REPLICA_GROUP``, ``"<group> <groups>"``); ``(0, 1)`` for a job that
    runs as one torch job."""
    value = environ.get(REPLICA_GROUP_ENV)
    if not value:
        return 0, 1
    group, groups = (int(part) for part in value.split())
    return group, groups


def restart_safe_store(timeout: timedelta) -> dist.Store | None:
    """The rendezvous store with this restart's own key space, under torch elastic's shared store.

    torch elastic (``torchrun``, plait's launcher) hands workers the agent's rendezvous TCPStore
    (``TORCHELASTIC_USE_AGENT_STORE=True``); it outlives a restart, so a restarted worker can read
    the previous attempt's process-group keys (a dead peer's gloo address) and fail in
    ``connectFullMesh`` (pytorch/pytorch#135712). Prefixing every key with the restart count
    gives each attempt a fresh key space. None: not under torch elastic's shared store.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout
    )
    return dist.PrefixStore(f"plait/attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}", store)
