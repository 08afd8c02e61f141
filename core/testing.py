"""Helpers for testing plait and in-house plugins: compose a config, run a real training job.

    from plait.testing import run_losses

    def test_my_plugin_keeps_losses(tmp_path):
        base = run_losses(tmp_path / "a", ["train.steps=5"])
        mine = run_losses(tmp_path / "b", ["train.steps=5", "+plugins=[my_team.fancy]"])
        assert mine == pytest.approx(base, rel=1e-6)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

from omegaconf import DictConfig

from plait import api
from plait.plan import make_plan

# Settings that keep a test run small and quiet: the tiny GPT, no W&B, a few steps.
TEST_OVERRIDES = ("model=gpt_tiny", "tracker=none", "train.steps=4", "train.batch_size=8",
                  "train.seq_len=32", "optimizer.warmup_steps=2")


def compose(overrides: Iterable[str] = (), plugins: Iterable[Any] = ()) -> DictConfig:
    """The config ``plait train <overrides>`` would run with (checked: raises ``PlanError``)."""
    return make_plan(overrides, plugins).check().cfg


def run_training(run_dir: str | Path, overrides: Iterable[str] = (),
                 plugins: Iterable[Any] = ()) -> Path:
    """Run ``plait train`` for real (worker processes included) into ``run_dir``."""
    run_dir = Path(run_dir)
    return api.train([*TEST_OVERRIDES, f"run.root={run_dir.parent}", f"run.name={run_dir.name}",
                      *overrides], plugins)


def run_losses(run_dir: str | Path, overrides: Iterable[str] = (),
               plugins: Iterable[Any] = ()) -> list[float]:
    """Per-step losses of a real run (read back from ``metrics.jsonl``)."""
    run_training(run_dir, overrides, plugins)
    return [m["loss"] for m in read_metrics(run_dir)]


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The logged steps of a run from ``run_dir/metrics.jsonl`` (written by the metrics_file
    plugin); a resumed run's steps follow the earlier ones."""
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]
