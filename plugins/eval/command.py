"""``plait eval <run or checkpoint dir> tasks=[...] [limit=N] [num_fewshot=K] [batch_size=B]
[include_path=DIR] [out=results.json]``: lm-evaluation-harness tasks on a checkpoint of any
layout, in one process.

The checkpoint is read as ``plait export`` reads it (every shard joined) into the unsplit
model; the text is encoded with the tokenizer the run's data was made with
(``plait_tokenizer``). The tasks are checked before any model is loaded. Prints the harness's
results table and writes its JSON (default: ``<checkpoint>/eval_results.json``).
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import torch

from plait.config import AT_LEAST_0, AT_LEAST_1, range_problems
from plait.plugins.eval.harness import HarnessSettings

USAGE = (
    "usage: plait eval <run dir | checkpoint dir> tasks=[TASK,...] [limit=N] "
    "[num_fewshot=K] [batch_size=B] [include_path=DIR] [out=results.json]"
)
RANGES = {"limit": AT_LEAST_1, "num_fewshot": AT_LEAST_0, "batch_size": AT_LEAST_1}
NO_TOKENIZER = (
    "the run's data does not say which tokenizer made its tokens (data=tokens); "
    "evaluate a run trained on data=stdlib|text|shards"
)


def parse(args: list[str]) -> tuple[str, HarnessSettings, str | None]:
    """The checkpoint path, the harness settings and ``out``; ``tasks=[a,b]`` or ``tasks=a,b``."""
    known = {f.name for f in fields(HarnessSettings)} | {"out"}
    paths, values = [], {}
    for arg in args:
        key, eq, value = arg.partition("=")
        if not eq or key not in known:
            paths.append(arg)
        elif key == "tasks":
            values[key] = [t.strip() for t in value.strip("[]").split(",") if t.strip()]
        elif key in RANGES:
            try:
                values[key] = int(value)
            except ValueError:
                raise ValueError(f"{key}={value} is not a whole number: {USAGE}") from None
        else:
            values[key] = value
    if len(paths) != 1 or not values.get("tasks"):
        raise ValueError(USAGE)
    out = values.pop("out", None)
    settings = HarnessSettings(**values)
    problems = range_problems("", settings.__dict__, RANGES)
    if problems:
        raise ValueError("; ".join(problems))
    return paths[0], settings, out


def check_tasks(checkpoint_path: str, settings: HarnessSettings):
    """The run's tokenizer, once the tasks are known to the harness and can be encoded (and
    generated text decoded): refused otherwise, before any model is loaded."""
    from plait.export import run_config
    from plait.plugin_manager import keep_selected, make_plugin_manager
    from plait.plugins.eval.registry import harness_problems, task_manager, task_problems

    if harness_problems("plait eval"):
        raise ValueError(harness_problems("plait eval")[0])
    if settings.include_path and not Path(settings.include_path).is_dir():
        raise ValueError(
            f"include_path={settings.include_path} is not a directory: give the "
            "directory holding your task YAML files"
        )
    cfg = run_config(checkpoint_path)
    tokenizer = keep_selected(make_plugin_manager(cfg), cfg).hook.plait_tokenizer(cfg=cfg)
    manager = task_manager(settings.include_path, tuple(settings.tasks))
    problems = task_problems(manager, settings.tasks, "tasks", tokenizer is not None, NO_TOKENIZER)
    if problems:
        raise ValueError("; ".join(problems))
    return tokenizer


def cmd_eval(args: list[str]) -> int:
    from plait.export import consolidate
    from plait.plugins.eval.harness import evaluate, table, write_json
    from plait.plugins.eval.lm import PlaitLM
    from plait.plugins.eval.scoring import LocalScorer

    path, settings, out = parse(args)
    tokenizer = check_tasks(path, settings)
    found = consolidate(path)
    model = found.model
    model.load_state_dict(found.state, assign=True)
    model.eval()
    length = found.cfg.train.seq_len
    scorer = LocalScorer(model, settings.batch_size, length, torch.device("cpu"))
    results = evaluate(PlaitLM(scorer, tokenizer, length), settings)
    print(table(results))
    target = write_json(results, Path(out) if out else found.checkpoint / "eval_results.json")
    print(f"plait: wrote {target}")
    return 0
