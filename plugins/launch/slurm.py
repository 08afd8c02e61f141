"""``launcher=slurm``: submit the run to SLURM through Hydra's submitit launcher, and inside the
allocation join every task into one torch job.

    plait train launcher=slurm launcher.nodes=2 launcher.tasks_per_node=4 \\
        launcher.gpus_per_node=4 launcher.partition=gpu launcher.time=120 launcher.account=proj

``conf/launcher/slurm.yaml`` selects ``hydra/launcher=submitit_slurm`` and sets
``hydra.mode: MULTIRUN``, so ``plait train`` (with or without ``-m``) hands the run to
``Hydra.multirun``; the submitit launcher writes the ``sbatch`` script, submits one job per run
(a job array for a sweep) and waits. In the allocation ``srun`` starts ``tasks_per_node`` tasks
per node, each runs the same Hydra job, and this plugin's ``plait_launch`` runs the worker in
place with the ``env://`` variables taken from SLURM's (:func:`torch_env_from_slurm`).

Any other setting of Hydra's submitit launcher is set directly, e.g.
``hydra.launcher.setup='[module load cuda]'`` or ``hydra.launcher.additional_parameters``.

With ``fault=torchft`` each replica group is a torch job of its own: task ``p`` is rank ``p % S``
of group ``p // S`` (``S`` tasks a group; whole groups on every node), and task 0's process also
runs torchft's lighthouse (``plait.plugins.fault.torchft``). A group whose task dies is not
restarted (there is no agent in an allocation, only SLURM's requeue of the whole job); the other
groups go on without it.

Taken from submitit and its Hydra launcher: the sbatch script, the job array, pickling the job,
waiting, requeue on timeout. Written here: the settings a plait user gives (their names are
``sbatch``'s), the mapping of SLURM's variables to torch's, and the checks.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from plait import hookimpl
from plait.config import AT_LEAST_1, LauncherConfig, Range, range_problems
from plait.plugins.launch.replica_groups import group_env, placement_problems, replica_groups
from plait.topology import first_host, in_srun_task, slurm_job_port
from plait.types import PluginInfo


@dataclass
class SlurmLauncherConfig(LauncherConfig):
    name: str = "slurm"
    nodes: int = 1  # sbatch --nodes
    tasks_per_node: int = 1  # sbatch --ntasks-per-node: one task per worker (per GPU)
    gpus_per_node: Optional[int] = None  # sbatch --gpus-per-node
    cpus_per_task: Optional[int] = None  # sbatch --cpus-per-task
    partition: Optional[str] = None  # sbatch --partition
    time: int = 60  # sbatch --time, in minutes
    account: Optional[str] = None  # sbatch --account
    qos: Optional[str] = None  # sbatch --qos
    constraint: Optional[str] = None  # sbatch --constraint
    mem_gb: Optional[int] = None  # sbatch --mem, per node
    master_port: int = 0  # 0: derived from the job id, the same in every task


RANGES = {
    "nodes": AT_LEAST_1,
    "tasks_per_node": AT_LEAST_1,
    "gpus_per_node": Range(0),
    "cpus_per_task": AT_LEAST_1,
    "time": Range(1, meaning="minutes"),
    "mem_gb": AT_LEAST_1,
    "master_port": Range(0, 65535, meaning="0: from the job id"),
}


def tasks_on_node(environ: Mapping[str, str]) -> str:
    """Tasks on this node: this node's entry of the step's ``SLURM_STEP_TASKS_PER_NODE`` (an
    ``srun`` inside an allocation may lay out fewer tasks than the job), else
    ``SLURM_NTASKS_PER_NODE`` where given, else the job's ``SLURM_TASKS_PER_NODE``
    (``2(x3),1``: 2 on each of the first three nodes, 1 on the 4th)."""
    if "SLURM_NTASKS_PER_NODE" in environ and "SLURM_STEP_TASKS_PER_NODE" not in environ:
        return environ["SLURM_NTASKS_PER_NODE"]
    node = int(environ.get("SLURM_NODEID", 0))
    counts = []
    per_node = environ.get(
        "SLURM_STEP_TASKS_PER_NODE", environ.get("SLURM_TASKS_PER_NODE", environ["SLURM_NTASKS"])
    )
    for part in per_node.split(","):
        count, _, times = part.partition("(x")
        counts += [count] * int(times.rstrip(")") or 1)
    return counts[min(node, len(counts) - 1)]


def torch_env_from_slurm(environ: Mapping[str, str], master_port: int) -> dict[str, str]:
    """The ``env://`` variables torch needs, from what ``srun`` sets in each task.

    The master is the first host of the job's node list (where rank 0 runs), not the node that
    ran ``srun``; the port, unless given, is derived from the job id so every task agrees.
    Variables already set (``MASTER_ADDR``, ``MASTER_PORT``) are kept.
    """
    if "RANK" in environ or not in_srun_task(environ):
        return {}
    port = slurm_job_port(environ, master_port)
    return {
        "RANK": environ["SLURM_PROCID"],
        "WORLD_SIZE": environ["SLURM_NTASKS"],
        "LOCAL_RANK": environ.get("SLURM_LOCALID", "0"),
        "LOCAL_WORLD_SIZE": tasks_on_node(environ),
        "GROUP_RANK": environ.get("SLURM_NODEID", "0"),
        "MASTER_ADDR": environ.get("MASTER_ADDR") or first_host(environ["SLURM_JOB_NODELIST"]),
        "MASTER_PORT": environ.get("MASTER_PORT") or str(port),
    }


def group_env_from_slurm(cfg, environ: Mapping[str, str], groups: int) -> dict[str, str]:
    """Each replica group its own torch job (``fault=torchft``): task ``p`` is rank ``p % S``
    of group ``p // S`` (``S`` tasks a group, whole groups on every node), which meets on its
    node at the job's port + 2 + its group (+ 1 is the lighthouse's)."""
    size = int(environ["SLURM_NTASKS"]) // groups
    group, rank = divmod(int(environ["SLURM_PROCID"]), size)
    port = slurm_job_port(environ, cfg.launcher.master_port) + 2 + group
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(size),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(size),
        "GROUP_RANK": "0",  # a group's job lies on one node
        "MASTER_ADDR": environ.get("SLURMD_NODENAME") or socket.gethostname(),
        "MASTER_PORT": str(port),
        **group_env(cfg, group, groups, size),
    }


def task_count_problems(cfg, dims, environ: Mapping[str, str]) -> list[str]:
    """Inside ``srun`` the tasks are the workers: their count must be the planned world size."""
    if not in_srun_task(environ) or "RANK" in environ:
        return []
    tasks = int(environ["SLURM_NTASKS"])
    planned = dims.nodes.max * cfg.launcher.nproc_per_node
    if tasks == planned:
        return []
    return [
        f"srun started {tasks} task(s) but the plan has launcher.nnodes * "
        f"launcher.nproc_per_node = {planned} workers: one task per worker (srun --ntasks="
        f"{planned}), or set the launcher's node and process counts to the tasks'"
    ]


@hookimpl
def plait_declare() -> PluginInfo:
    return PluginInfo(
        name="slurm_launcher",
        selected_by={"launcher.name": "slurm"},
        description="submit through Hydra's submitit launcher; in the allocation "
        "each srun task is one worker",
    )


@hookimpl
def plait_register_configs(config_store) -> None:
    config_store.store(group="launcher", name="base_slurm", node=SlurmLauncherConfig)


@hookimpl
def plait_validate(cfg, dims, hook) -> list[str]:
    launcher = cfg.launcher
    problems = range_problems("launcher", launcher, RANGES)
    if (launcher.nnodes, launcher.nproc_per_node) != (launcher.nodes, launcher.tasks_per_node):
        problems.append(
            f"launcher=slurm takes its layout from launcher.nodes={launcher.nodes} and "
            f"launcher.tasks_per_node={launcher.tasks_per_node}; do not set launcher.nnodes="
            f"{launcher.nnodes} or launcher.nproc_per_node={launcher.nproc_per_node}"
        )
    groups = replica_groups(cfg, dims, hook)
    if groups > 1:
        problems += placement_problems(cfg, dims, groups, setting="launcher.tasks_per_node")
    return problems + task_count_problems(cfg, dims, os.environ)


@hookimpl
def plait_launch(cfg, dims, entrypoint, args, hook) -> dict[int, Any]:
    if not in_srun_task(os.environ):  # plait.api.train(["launcher=slurm"]) from Python
        raise ValueError(
            "launcher=slurm runs its workers as the tasks of a SLURM job, which `plait train "
            "launcher=slurm ...` submits through Hydra's submitit launcher; this process is not "
            "such a task (inside an sbatch script use `srun plait train launcher=local ...`)"
        )
    groups = replica_groups(cfg, dims, hook)
    if groups > 1:  # each replica group its own torch job, the tasks its workers (no agent)
        os.environ.update(group_env_from_slurm(cfg, os.environ, groups))
        return {int(os.environ["SLURM_PROCID"]): entrypoint(*args)}
    os.environ.update(torch_env_from_slurm(os.environ, cfg.launcher.master_port))
    return {int(os.environ["RANK"]): entrypoint(*args)}
