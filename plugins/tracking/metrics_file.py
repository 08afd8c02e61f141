"""Writes every logged step's metrics as one JSON line to ``run.dir/metrics.jsonl`` (rank 0).

A plain record that needs no tracker: scripts and tests compare runs by reading it back.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from plait import hookimpl
from plait.types import PluginInfo


class MetricsFile:
    def __init__(self) -> None:
        self.path: Path | None = None

    @hookimpl
    def plait_declare(self) -> PluginInfo:
        return PluginInfo(name="metrics_file", description="run.dir/metrics.jsonl from rank 0")

    @hookimpl
    def plait_on_run_start(self, cfg, state) -> None:
        """A resumed run drops the lines of steps after its checkpoint (the run that wrote them
        crashed; they are logged again), so no step appears twice."""
        self.path = Path(cfg.run.dir) / "metrics.jsonl"
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
