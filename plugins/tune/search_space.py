"""Hydra's sweep syntax as search spaces, the way Hydra's Optuna sweeper reads it.

    optimizer.lr='tag(log,interval(1e-4,1e-2))'    -> FloatDistribution(1e-4, 1e-2, log=True)
    train.batch_size=interval(8,64)                -> IntDistribution(8, 64)
    strategy=ddp,zero2 | 'choice(ddp,zero2)'       -> CategoricalDistribution(["ddp", "zero2"])
    train.grad_accum_steps='range(1,5)'            -> IntDistribution(1, 4)

A non-sweep override (``train.steps=100``) is passed to every trial as it is. The mapping is that
of ``hydra_plugins/hydra_optuna_sweeper/_impl.py`` (``create_optuna_distribution_from_override``)
on Optuna's current distribution classes, with one fix: ``range`` excludes its stop, as in
Python and Hydra's basic sweeper.
"""

from __future__ import annotations

from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import IntervalSweep, Override, RangeSweep, Transformer


def distribution(override: Override):
    """The search space one sweep override describes, as an Optuna distribution."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    value = override.value()
    if override.is_choice_sweep() or (isinstance(value, RangeSweep) and value.shuffle):
        choices = list(override.sweep_iterator(transformer=Transformer.encode))
        for choice in choices:
            if not isinstance(choice, (str, int, float, bool, type(None))):
                raise ValueError(
                    f"{override.input_line}: a choice takes str, int, float, bool "
                    f"or null values, not {type(choice).__name__}"
                )
        return CategoricalDistribution(choices)
    if isinstance(value, RangeSweep):
        numbers = (value.start, value.stop, value.step)
        if any(isinstance(x, float) for x in numbers):
            last = value.start + value.step * ((value.stop - value.start) // value.step - 1)
            return FloatDistribution(value.start, last, step=value.step)
        return IntDistribution(
            int(value.start), int(value.stop) - int(value.step), step=int(value.step)
        )
    if isinstance(value, IntervalSweep):
        log = "log" in value.tags
        if isinstance(value.start, int) and isinstance(value.end, int):
            return IntDistribution(value.start, value.end, log=log)
        return FloatDistribution(float(value.start), float(value.end), log=log)
    raise ValueError(
        f"{override.input_line}: not a sweep this sweeper understands (use "
        "interval(...), tag(log, interval(...)), choice(...), range(...) or a,b,c)"
    )


def parse(arguments: list[str]) -> tuple[dict[str, Any], dict[str, str], dict[str, list[Any]]]:
    """Split overrides into the search space, the fixed overrides, and the listed choices
    (``a,b,c`` in the order given, which a population can take one by one).

    :return: ``(space, fixed, listed)``: distributions by key, fixed values by key (as typed),
        and for each choice sweep its values in order.
    """
    space: dict[str, Any] = {}
    fixed: dict[str, str] = {}
    listed: dict[str, list[Any]] = {}
    for override in OverridesParser.create().parse_overrides(arguments):
        key = override.get_key_element()
        if not override.is_sweep_override():
            fixed[key] = override.get_value_element_as_str()
            continue
        space[key] = distribution(override)
        if override.is_choice_sweep():
            listed[key] = list(space[key].choices)
    return space, fixed, listed


def as_overrides(params: dict[str, Any], fixed: dict[str, str]) -> list[str]:
    """``key=value`` overrides for one trial (sampled values first, then the fixed ones)."""
    return [f"{key}={value}" for key, value in {**params, **fixed}.items()]
