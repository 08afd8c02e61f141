"""``plait compare A B [rtol=1e-4] [grad_norm_rtol=1e-3]``: are two runs the same math?

The check users make by hand after changing the layout (torchtitan#771, instructlab/training#543):
step by step over the steps both runs logged, the relative difference of the loss and of the
gradient norm::

    rel(a, b) = |a - b| / max(|a|, |b|)          (0 when both are 0; NaN only equals NaN)

It prints every step, the largest of each, and "same" when every loss is within ``rtol`` and
every gradient norm within ``grad_norm_rtol``, else "differs at step k" (the first step out of
tolerance); the exit code is 0 for same, 1 for differs. The default tolerances hold for fp32 runs
of one model under different layouts (summation orders differ, so losses agree to about 1e-6 and
drift slowly); compare bf16 runs with looser ones.
"""

from __future__ import annotations

import math

from plait.plugins.report.runs import Run, find_runs, layout

USAGE = "usage: plait compare <run dir A> <run dir B> [rtol=1e-4] [grad_norm_rtol=1e-3]"
DEFAULTS = {"rtol": 1e-4, "grad_norm_rtol": 1e-3}


def relative_difference(a: float, b: float) -> float:
    if math.isnan(a) or math.isnan(b):
        return 0.0 if math.isnan(a) and math.isnan(b) else math.inf
    if a == b:
        return 0.0
    return abs(a - b) / max(abs(a), abs(b))


def compare(a: Run, b: Run, rtol: float, grad_norm_rtol: float) -> tuple[list[str], int | None]:
    """The lines to print, and the first step out of tolerance (None: the same)."""
    by_step_b = {m["step"]: m for m in b.steps}
    common = [(m, by_step_b[m["step"]]) for m in a.steps if m["step"] in by_step_b]
    if not common:
        raise ValueError(f"{a.directory} and {b.directory} have no logged step in common")
    lines = [
        f"A: {a.directory} ({describe(a)})",
        f"B: {b.directory} ({describe(b)})",
        f"{'step':>6} {'loss A':>12} {'loss B':>12} {'loss rel diff':>14} "
        f"{'grad_norm rel diff':>19}",
    ]
    worst = {"loss": (0.0, None), "grad_norm": (0.0, None)}
    first_bad = None
    for ma, mb in common:
        step = ma["step"]
        loss = relative_difference(ma["loss"], mb["loss"])
        norm = (
            relative_difference(ma["grad_norm"], mb["grad_norm"])
            if "grad_norm" in ma and "grad_norm" in mb
            else 0.0
        )
        for name, value in (("loss", loss), ("grad_norm", norm)):
            if value > worst[name][0]:
                worst[name] = (value, step)
        bad = loss > rtol or norm > grad_norm_rtol
        if bad and first_bad is None:
            first_bad = step
        lines.append(
            f"{step:>6} {ma['loss']:>12.8g} {mb['loss']:>12.8g} {loss:>14.3e} "
            f"{norm:>19.3e}" + ("   <- out of tolerance" if bad else "")
        )
    lines.append(
        "largest relative difference: "
        + ", ".join(
            f"{name.replace('_', ' ')} {value:.3e}" + (f" at step {step}" if step else "")
            for name, (value, step) in worst.items()
        )
    )
    extra = {run.directory: len(run.steps) - len(common) for run in (a, b)}
    if any(extra.values()):
        lines.append(
            "compared the steps both logged; "
            + ", ".join(f"{d} has {n} more" for d, n in extra.items() if n)
        )
    tolerance = f"rtol={rtol:g} (loss), grad_norm_rtol={grad_norm_rtol:g}"
    if first_bad is None:
        lines.append(f"same: every one of the {len(common)} common steps is within {tolerance}")
    else:
        lines.append(f"differs at step {first_bad}: outside {tolerance}")
    return lines, first_bad


def describe(run: Run) -> str:
    row = layout(run)
    return ", ".join(
        f"{k} {v}"
        for k, v in row.items()
        if k in ("strategy", "dp x tp x pp", "comm", "precision", "layout")
    )


def cmd_compare(args: list[str]) -> int:
    options = dict(DEFAULTS)
    paths = []
    for arg in args:
        key, _, value = arg.partition("=")
        if not value:
            paths.append(arg)
        elif key in options:
            options[key] = float(value)
        else:
            raise ValueError(f"plait compare takes no {key}=: {USAGE}")
    if len(paths) != 2:
        raise ValueError(USAGE)
    runs = [find_runs([path]) for path in paths]
    for path, found in zip(paths, runs):
        if len(found) != 1:
            raise ValueError(
                f"{path} holds {len(found)} runs (a sweep): compare two runs, e.g. "
                f"{found[0].directory} and {found[1].directory}"
            )
    lines, first_bad = compare(runs[0][0], runs[1][0], **options)
    print("\n".join(lines))
    return 0 if first_bad is None else 1
