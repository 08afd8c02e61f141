"""Checks the built-in model plugins share: context length, and the sizes tensor parallelism
must divide (named by the model's own settings, so the message says what to change)."""

from __future__ import annotations


def context_problems(cfg, block_size: int) -> list[str]:
    if cfg.train.seq_len <= block_size:
        return []
    return [
        f"train.seq_len={cfg.train.seq_len} is longer than the model's context "
        f"model.block_size={block_size}: lower train.seq_len or raise model.block_size"
    ]


def tensor_parallel_problems(cfg, tp: int, divides: dict[str, str]) -> list[str]:
    """``divides`` maps a ``model.*`` setting to what it counts; tp must divide each."""
    problems = []
    for key, what in divides.items():
        value = cfg.model[key]
        if tp == 1 or value % tp == 0:
            continue
        if key == "vocab_size":  # padded rows are never a target (GPT-2 pads 50257 to 50304)
            fix = f"pad it: model.{key}={-(-value // tp) * tp}"
        else:
            fix = f"choose tp in {[d for d in range(1, value + 1) if value % d == 0]}"
        problems.append(f"parallel.tp={tp} does not divide model.{key}={value} ({what}): {fix}")
    return problems
