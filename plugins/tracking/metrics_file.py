"""Writes every logged step's metrics as one JSON line to ``run.dir/metrics.jsonl`` (rank 0).

A plain record that needs no tracker: scripts and tests compare runs by reading it back.
"""

from __future__ import annotations

import json
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
    def plait_on_run_start(self, cfg) -> None:
        self.path = Path(cfg.run.dir) / "metrics.jsonl"

    @hookimpl
    def plait_log_metrics(self, step, metrics) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")


plugin = MetricsFile()
