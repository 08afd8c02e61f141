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

Taken from submitit and its Hydra launcher: the sbatch script, the job array, pickling the job,
waiting, requeue on timeout. Written here: the settings a plait user gives (their names are
``sbatch``'s), the mapping of SLURM's variables to torch's, and the checks.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from plait import hookimpl
from plait.config import AT_LEAST_1, LauncherConfig, Range, range_problems
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


def in_srun_task(environ: Mapping[str, str]) -> bool:
    """True in a task ``srun`` started (``SLURM_STEP_ID`` is set); False in the batch step of
    an ``sbatch`` script, which has ``SLURM_PROCID=0`` and ``SLURM_NTASKS`` of the whole job but
    is one process, not a task of a job step."""
    return "SLURM_PROCID" in environ and "SLURM_STEP_ID" in environ


def first_host(nodelist: str) -> str:
    """The first host of a SLURM host list: ``gpu[003-004,010],cpu1`` -> ``gpu003``."""
    match = re.match(r"([^,\[]*)(?:\[([^\]]*)\](.*?))?(?:,|$)", nodelist)
    prefix, ranges, suffix = match.group(1), match.group(2), match.group(3) or ""
    if ranges is None:
        return prefix
    return prefix + re.split(r"[,-]", ranges)[0] + suffix


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
    job_id = int(re.sub(r"\D", "", environ.get("SLURM_JOB_ID", "0")) or 0)
    port = master_port or 20000 + job_id % 40000
    return {
        "RANK": environ["SLURM_PROCID"],
        "WORLD_SIZE": environ["SLURM_NTASKS"],
        "LOCAL_RANK": environ.get("SLURM_LOCALID", "0"),
        "LOCAL_WORLD_SIZE": tasks_on_node(environ),
        "GROUP_RANK": environ.get("SLURM_NODEID", "0"),
        "MASTER_ADDR": environ.get("MASTER_ADDR") or first_host(environ["SLURM_JOB_NODELIST"]),
        "MASTER_PORT": environ.get("MASTER_PORT") or str(port),
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
def plait_validate(cfg, dims) -> list[str]:
    launcher = cfg.launcher
    problems = range_problems("launcher", launcher, RANGES)
    if (launcher.nnodes, launcher.nproc_per_node) != (launcher.nodes, launcher.tasks_per_node):
        problems.append(
            f"launcher=slurm takes its layout from launcher.nodes={launcher.nodes} and "
            f"launcher.tasks_per_node={launcher.tasks_per_node}; do not set launcher.nnodes="
            f"{launcher.nnodes} or launcher.nproc_per_node={launcher.nproc_per_node}"
        )
    return problems + task_count_problems(cfg, dims, os.environ)


@hookimpl
def plait_launch(cfg, entrypoint, args) -> dict[int, Any]:
    if not in_srun_task(os.environ):  # plait.api.train(["launcher=slurm"]) from Python
        raise ValueError(
            "launcher=slurm runs its workers as the tasks of a SLURM job, which `plait train "
            "launcher=slurm ...` submits through Hydra's submitit launcher; this process is not "
            "such a task (inside an sbatch script use `srun plait train launcher=local ...`)"
        )
    os.environ.update(torch_env_from_slurm(os.environ, cfg.launcher.master_port))
    return {int(os.environ["RANK"]): entrypoint(*args)}
