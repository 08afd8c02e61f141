"""Where ``plait prepare`` runs its units of work (:mod:`plait.plugins.data.work`):

- ``launcher=local`` (default): ``data.num_workers`` processes on this machine;
- ``launcher=slurm``: a SLURM job array through submitit, ``launcher.tasks`` array tasks, each
  running ``data.num_workers`` processes (0: one per core SLURM gave it). The command waits for
  the array, as Hydra's submitit launcher does, then submits the next phase. Array tasks that
  fail or are killed (their units left without a marker) are submitted again, up to
  ``launcher.retries`` times; units that finished are never redone.

``out`` must be where every node sees it (a shared file system or object storage). No scheduler
is written here: submitit writes the sbatch script, submits the array, pickles the call and
reports each task's end; ``work.run_units`` is what each array task runs.
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from plait.plugins.data.work import Work, run_units, undone


@dataclass
class PrepareLauncherConfig:
    """``launcher=local|slurm`` of ``plait prepare`` (``slurm``'s names are sbatch's)."""

    name: str = "local"
    tasks: int = 1  # slurm: array tasks (sbatch --array=0-<tasks-1>)
    cpus_per_task: Optional[int] = None  # sbatch --cpus-per-task
    partition: Optional[str] = None  # sbatch --partition
    time: int = 60  # sbatch --time, minutes per array task
    account: Optional[str] = None  # sbatch --account
    qos: Optional[str] = None  # sbatch --qos
    constraint: Optional[str] = None  # sbatch --constraint
    mem_gb: Optional[int] = None  # sbatch --mem
    retries: int = 2  # times unfinished units are submitted again after array tasks fail
    folder: Optional[str] = None  # submitit's logs and pickles; null: <out>/work/slurm
    additional_parameters: dict[str, Any] = field(default_factory=dict)  # other sbatch options


NAMES = ("local", "slurm")


class PrepareFailed(ValueError):
    """Units of work that did not finish; the message says which, why, and how to resume."""


def launcher_problems(launcher) -> list[str]:
    problems = []
    if launcher.name not in NAMES:
        problems.append(
            f"launcher={launcher.name}: plait prepare runs on launcher=local or launcher=slurm"
        )
    if launcher.tasks < 1:
        problems.append(f"launcher.tasks={launcher.tasks} is out of range: set launcher.tasks >= 1")
    if launcher.retries < 0:
        problems.append(
            f"launcher.retries={launcher.retries} is out of range: set launcher.retries >= 0"
        )
    return problems


def run(
    launcher,
    work: Work,
    phase: str,
    count: int,
    workers: int,
    log: Callable,
    progress: Optional[Callable[[int], None]] = None,
) -> None:
    """Run every unfinished unit of ``phase`` (``count`` units in all)."""
    pending = undone(work, phase, count)
    if not pending:
        return
    if launcher.name == "local":
        run_units(work.out, phase, pending, workers, progress)
        return
    run_slurm_array(launcher, work, phase, count, pending, workers, log)


def run_slurm_array(
    launcher, work: Work, phase: str, count: int, pending: list[int], workers: int, log: Callable
) -> None:
    import submitit

    folder = launcher.folder or (
        os.path.join(work.dir, "slurm") if work.local else os.path.abspath("plait-prepare-slurm")
    )
    executor = submitit.SlurmExecutor(folder=os.path.join(folder, "%j"))
    executor.update_parameters(
        job_name=f"plait-prepare-{phase}",
        time=launcher.time,
        nodes=1,
        ntasks_per_node=1,
        cpus_per_task=launcher.cpus_per_task,
        partition=launcher.partition,
        account=launcher.account,
        qos=launcher.qos,
        constraint=launcher.constraint,
        mem=f"{launcher.mem_gb}GB" if launcher.mem_gb else None,
        additional_parameters=dict(launcher.additional_parameters),
    )
    for attempt in range(launcher.retries + 1):
        groups = [pending[i :: launcher.tasks] for i in range(min(launcher.tasks, len(pending)))]
        try:
            jobs = executor.map_array(
                run_units,
                [work.out] * len(groups),
                [phase] * len(groups),
                groups,
                [workers] * len(groups),
            )
        except Exception as e:  # sbatch missing, refused, or no controller to talk to
            said = " ".join(str(e).split())[-600:]
            raise PrepareFailed(
                f"launcher=slurm could not submit the job array "
                f"({type(e).__name__}: {said}): check that sbatch works here "
                "and the launcher settings; run the same command again to "
                "resume"
            ) from None
        log(
            f"plait prepare: {phase}: job array {jobs[0].job_id.split('_')[0]}, "
            f"{len(groups)} task(s), {len(pending)} unit(s)"
        )
        failures = wait_for(jobs)
        pending = undone(work, phase, count)
        if not pending:
            return
        log(
            f"plait prepare: {phase}: {len(failures)} array task(s) did not finish "
            f"({'; '.join(failures)}); {len(pending)} unit(s) left"
            + (", submitting them again" if attempt < launcher.retries else "")
        )
    raise PrepareFailed(
        f"{len(pending)} {phase} unit(s) of plait prepare still unfinished "
        f"after {launcher.retries + 1} job array(s) ({'; '.join(failures)}); "
        f"logs in {folder}: fix the cause and run the same command again to resume"
    )


ACTIVE = (
    "PENDING",
    "CONFIGURING",
    "RUNNING",
    "COMPLETING",
    "SUSPENDED",
    "REQUEUED",
    "RESIZING",
    "SIGNALING",
    "STAGE_OUT",
)


def wait_for(jobs, poll_s: float = 1.0) -> list[str]:
    """Wait for every array task; what each failed one said. A task is over when submitit has
    its result, or when SLURM no longer lists it as active: submitit learns of a task killed
    before writing a result from ``sacct``, which a cluster without accounting (the tests'
    controller) does not answer, and would wait for it forever."""
    failures, waiting = [], list(jobs)
    while waiting:
        states = queue_states([job.job_id for job in waiting])
        for job in list(waiting):
            over = states.get(job.job_id, "GONE") not in ACTIVE
            if not job.paths.result_pickle.exists() and not over:
                continue
            waiting.remove(job)
            if job.paths.result_pickle.exists():
                try:
                    job.result()
                    continue
                except Exception as e:  # the task's own error, with its traceback
                    said = str(e).strip().splitlines()
                    failures.append(
                        f"array task {job.job_id}: {type(e).__name__}: {said[-1] if said else ''}"
                    )
            else:
                failures.append(
                    f"array task {job.job_id} ended without a result "
                    f"(SLURM: {states.get(job.job_id, 'no longer listed')})"
                )
        if waiting:
            time.sleep(poll_s)
    return failures


def queue_states(job_ids: list[str]) -> dict[str, str]:
    """SLURM's state of each job (array tasks one a line), from ``squeue``."""
    shown = subprocess.run(
        ["squeue", "-h", "-r", "-t", "all", "-o", "%i %T", "-j", ",".join(job_ids)],
        capture_output=True,
        text=True,
    )
    return dict(line.split()[:2] for line in shown.stdout.splitlines() if len(line.split()) >= 2)
