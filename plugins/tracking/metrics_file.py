"""Writes every logged step's metrics as one JSON line to ``run.dir/metrics.jsonl`` (rank 0).

A plain record that needs no tracker: scripts and tests compare runs by reading it back. Where
the replica groups run as torch jobs of their own (``fault=torchft``), each group's first rank
logs its group's view: group 0 into ``run.dir/metrics.jsonl``, group ``g`` into
``run.dir/replica_groups/<g>/metrics.jsonl``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from plait import hookimpl
from plait.types import PluginInfo


def metrics_path(run_dir: Path, replica_group: int = 0) -> Path:
    """Where a replica group's first rank logs (group 0, or a job that runs as one: the run's)."""
    if replica_group == 0:
        return run_dir / "metrics.jsonl"
    return run_dir / "replica_groups" / str(replica_group) / "metrics.jsonl"


class MetricsFile:
    def __init__(self) -> None:
        self.path: Path | None = None

    @hookimpl
    def plait_declare(self) -> PluginInfo:
        return PluginInfo(name="metrics_file", description="run.dir/metrics.jsonl from rank 0")

    @hookimpl
    def plait_on_run_start(self, cfg, state, topology) -> None:
        """A resumed run drops the lines of steps after its checkpoint (the run that wrote them
        crashed; they are logged again), so no step appears twice."""
        self.path = metrics_path(Path(cfg.run.dir), topology.replica_group_id)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if state.step and self.path.exists():
            lines = self.path.read_text().splitlines(keepends=True)
            kept = [
                line
                for line in lines  # a line cut short by the crash is dropped too
                if line.endswith("\n") and json.loads(line)["step"] <= state.step
            ]
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text("".join(kept))
            os.replace(tmp, self.path)

    @hookimpl
    def plait_log_metrics(self, step, metrics) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")


plugin = MetricsFile()
