"""``bench_parity.py --alternate SECONDS``: the sides of a row run at the same time, taking turns
on the cores, so that the host's slow and fast spells fall on both.

On a shared 2-core host the speed of the same loop moves by 10-30% from one minute to the next
(docs/benchmarks.md), and two runs made a minute apart differ by more than the 3% the parity
target allows. Here every side of a row is started once and, while the others are frozen, runs
for ``SECONDS``; then the next side runs, in rotation, until all have ended. A frozen job is a
cgroup frozen as a whole (cgroup v1's ``freezer.state``, v2's ``cgroup.freeze``): the kernel
stops all its processes together and resumes them transparently, with no signal delivered (a
``SIGSTOP`` would end the workers' ``epoll_wait`` with ``EINTR``). Each side's steady step time
is then measured per turn: the gaps between step ends that lie in one turn, without the turn's
first step (it began frozen or ran on cold caches) and the ``--warmup`` steps. The ratio of
each of plait's turns is taken against the mean of the plain loop's turns just before and just
after it (a drift of the host's speed cancels to first order).

Needs root and a cgroup freezer (v1 ``/sys/fs/cgroup/freezer`` or cgroup v2).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

V2 = Path("/sys/fs/cgroup/cgroup.controllers").exists()
FREEZER_BASE = Path("/sys/fs/cgroup" if V2 else "/sys/fs/cgroup/freezer")


def freezer_problem() -> str | None:
    """Why jobs cannot be frozen here, or None."""
    if os.geteuid() != 0:
        return "--alternate needs root (it freezes each job's cgroup)"
    if not FREEZER_BASE.is_dir():
        return f"--alternate needs a cgroup freezer ({FREEZER_BASE} is missing)"
    return None


class Freezer:
    """One job's freezer cgroup (with cgroup v2 the job's memory cgroup itself)."""

    def __init__(self, group: Path | None, name: str):
        self.own = group is None or not V2
        self.group = FREEZER_BASE / f"plait-parity-{os.getpid()}-{name}" if self.own else group
        if self.own:
            self.group.mkdir()

    @property
    def procs(self) -> Path:
        return self.group / "cgroup.procs"

    def set(self, frozen: bool) -> None:
        """Freeze or thaw every process of the job; returns once the kernel says it is done."""
        if V2:
            (self.group / "cgroup.freeze").write_text("1" if frozen else "0")
            wanted = f"frozen {int(frozen)}"
            while wanted not in (self.group / "cgroup.events").read_text():
                time.sleep(0.001)
            return
        state = "FROZEN" if frozen else "THAWED"
        (self.group / "freezer.state").write_text(state)
        while (self.group / "freezer.state").read_text().strip() != state:
            time.sleep(0.001)

    def close(self) -> None:
        self.set(False)
        if self.own:
            remove_when_empty(self.group)


def remove_when_empty(group: Path) -> None:
    """Remove a cgroup once the last of its processes has ended."""
    while (group / "cgroup.procs").read_text().strip():
        time.sleep(0.05)
    group.rmdir()


@dataclass
class Turns:
    """One side's job: its command, and when it ran (thawed) and was frozen."""

    name: str
    command: list[str]
    env: dict
    clock: Path
    log: Path
    turns: list[tuple[float, float]] = field(default_factory=list)


def take_turns(jobs: list[Turns], seconds: float, memories: dict, freezers: dict) -> None:
    """Run ``jobs`` one at a time, ``seconds`` each in rotation, until all have ended; each starts
    at its first turn (in its groups: ``memories`` and ``freezers`` by name)."""
    processes: dict[str, subprocess.Popen] = {}
    turn = 0
    while True:
        waiting = [
            job for job in jobs if job.name not in processes or processes[job.name].poll() is None
        ]
        if not waiting:
            break
        job = waiting[turn % len(waiting)]
        turn += 1
        start = time.time()
        if job.name in processes:
            freezers[job.name].set(False)
        else:
            joins = " && ".join(
                f"echo $$ > {procs}"
                for procs in (memories[job.name].procs, freezers[job.name].procs)
                if procs is not None
            )
            with job.log.open("w") as log:
                processes[job.name] = subprocess.Popen(
                    ["sh", "-c", f'{joins} && exec "$@"', "sh", *job.command],
                    env=job.env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
        try:
            processes[job.name].wait(timeout=seconds if len(waiting) > 1 else None)
        except subprocess.TimeoutExpired:
            freezers[job.name].set(True)
        job.turns.append((start, time.time()))
    for job in jobs:
        if processes[job.name].returncode:
            output = job.log.read_text()[-4000:]
            raise RuntimeError(
                f"{job.name} failed (exit {processes[job.name].returncode}):\n{output}"
            )


def turn_steps(
    ends: list[float], turns: list[tuple[float, float]], warmup: int, values: list[float]
) -> list[tuple[float, float | None]]:
    """Each turn's start and median step in ``values`` (the wall clock's step ends, or the CPU
    time's): gaps between consecutive steps whose ends (wall clock) lie inside the turn, after
    ``warmup`` steps, without the turn's first step; None for a turn with fewer than 3."""
    medians = []
    for start, stop in turns:
        inside = {i for i, end in enumerate(ends) if start <= end <= stop and i >= warmup}
        gaps = [values[i] - values[i - 1] for i in sorted(inside) if i - 1 in inside]
        medians.append((start, statistics.median(gaps) if len(gaps) >= 3 else None))
    return medians


def neighbour_ratios(
    numerator: list[tuple[float, float | None]], denominator: list[tuple[float, float | None]]
) -> list[float]:
    """For each turn of the denominator side ``(start, step s)``: the mean step time of the
    numerator side's turns just before and just after it, over its own (turns without a figure
    skipped; a turn with a neighbour on one side only uses that one)."""
    ratios = []
    timed = [(start, step) for start, step in numerator if step is not None]
    for start, step in denominator:
        if step is None:
            continue
        before = [s for t, s in timed if t < start][-1:]
        after = [s for t, s in timed if t > start][:1]
        if before or after:
            ratios.append(statistics.fmean(before + after) / step)
    return ratios


def read_clock(clock: Path) -> tuple[list[float], list[float]]:
    stamps = json.loads(clock.read_text())
    return [w for w, _ in stamps], [c for _, c in stamps]
