"""One run of lm-evaluation-harness over plait's model: ``lm_eval.simple_evaluate`` with a
:class:`~.lm.PlaitLM`, its results as metrics (``eval/<task>/<metric>``), its table and its JSON.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from plait.plugins.eval.registry import task_manager


@dataclass
class HarnessSettings:
    """What ``plait eval`` and ``eval.*`` pass to the harness."""

    tasks: list[str]
    limit: Optional[int] = None
    num_fewshot: Optional[int] = None
    batch_size: int = 8
    include_path: Optional[str] = None


def evaluate(lm, settings: HarnessSettings) -> dict[str, Any]:
    """The harness's results dict (``results``, ``configs``, ``samples`` per request, ...)."""
    from lm_eval import simple_evaluate

    return simple_evaluate(
        model=lm,
        tasks=list(settings.tasks),
        num_fewshot=settings.num_fewshot,
        limit=settings.limit,
        batch_size=settings.batch_size,
        log_samples=True,
        task_manager=task_manager(settings.include_path, tuple(settings.tasks)),
    )


def metrics_of(results: dict[str, Any]) -> dict[str, float]:
    """``eval/<task>/<metric>`` for every number the harness reports (``acc``,
    ``acc_stderr``, ``exact_match``, ...); a metric of a filter other than ``none`` as
    ``eval/<task>/<metric>/<filter>``."""
    metrics = {}
    for task, values in results["results"].items():
        for key, value in values.items():
            metric, _, filter_name = key.partition(",")
            if not filter_name or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            suffix = "" if filter_name == "none" else f"/{filter_name}"
            metrics[f"eval/{task}/{metric}{suffix}"] = float(value)
    return metrics


def table(results: dict[str, Any]) -> str:
    from lm_eval.utils import make_table

    text = make_table(results)
    return text + ("\n" + make_table(results, "groups") if results.get("groups") else "")


def write_json(results: dict[str, Any], path: Path) -> Path:
    """The results as the harness's own command writes them (its encoder for what JSON
    lacks)."""
    from lm_eval.utils import handle_non_serializable

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(
        json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False)
    )
    tmp.replace(path)
    return path
