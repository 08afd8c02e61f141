"""Enumerate the layouts of a world size, estimate each, check the best through the real plan.

Searched: ``dp × cp × tp × pp = world_size`` (every factorisation; context parallelism only
pays where the activations of whole sequences do not fit, its term in the memory estimate), for
a model with experts ``parallel.ep`` (every divisor of dp that divides ``model.n_experts``; not
with cp), every ``strategy.name`` an installed plugin is selected by and estimates
(``plait_strategy_cost``: ddp, zero0-3, fsdp and any in-house strategy that answers), the
micro-batch (every divisor of the data-parallel rank's batch ``train.batch_size / dp``, the
rest of the batch accumulated) and ``train.activation_checkpointing=none|selective|full``. A
setting the user gives on the command line (``strategy=zero1``, ``parallel.tp=2``,
``parallel.cp=1``, ``parallel.ep=2``, ``train.grad_accum_steps=4``,
``train.activation_checkpointing=full``, ``parallel.pp=1``) is kept and not searched.

Each candidate is estimated (:mod:`.cost`), those within the memory budget are sorted by step
time, and then checked in that order with :func:`plait.plan.plan_config`, the check every run
gets (core rules, capabilities, every plugin's ``plait_validate``), until ``top`` pass: a layout
a plugin refuses is dropped and its reason counted. One variant (micro-batch, recompute) per
strategy and mesh is kept, the fastest that passes; a mesh refused for a reason that names no
micro-batch or recompute setting (e.g. ``parallel.tp=8`` not dividing the heads) is not checked
again with another variant: checking is what costs time (one plan each).
"""

from __future__ import annotations

import copy
import re
from collections import Counter
from dataclasses import dataclass, field

from omegaconf import DictConfig, OmegaConf

from plait.plan import compose_config, plan_config
from plait.plugin_manager import PlaitPluginManager
from plait.plugins.planner.cost import Cost, Layout, Workload, cost

ACTIVATION_CHECKPOINTING = ("none", "selective", "full")
# settings a layout sets; given on the command line, they are fixed instead of searched
SEARCHED = (
    "strategy",
    "parallel.dp",
    "parallel.cp",
    "parallel.tp",
    "parallel.pp",
    "parallel.ep",
    "train.grad_accum_steps",
    "pipeline.microbatches",
    "train.activation_checkpointing",
)
# A refusal naming none of these holds for every micro-batch and recompute of its mesh: the
# mesh's other variants are not checked.
VARIANT_SETTINGS = (
    "train.batch_size",
    "train.grad_accum_steps",
    "pipeline.microbatches",
    "train.activation_checkpointing",
)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def split_overrides(overrides: list[str]) -> tuple[dict[str, str], list[str]]:
    """The searched settings the user fixed, and the other overrides."""
    fixed, rest = {}, []
    for override in overrides:
        key, _, value = override.partition("=")
        if key in SEARCHED:
            fixed[key] = value
        else:
            rest.append(override)
    return fixed, rest


def enumerate_layouts(
    world_size: int,
    batch_size: int,
    fixed: dict[str, str],
    strategies: list[str],
    n_experts: int = 0,
) -> list[Layout]:
    def choices(key: str, default):
        return [type(default[0])(fixed[key])] if key in fixed else list(default)

    layouts = []
    for tp in choices("parallel.tp", divisors(world_size)):
        for pp in choices(
            "parallel.pp", divisors(world_size // tp) if world_size % tp == 0 else [1]
        ):
            rest = world_size // (tp * pp) if world_size % (tp * pp) == 0 else 1
            for cp in choices("parallel.cp", divisors(rest)):
                dp = max(1, rest // cp)
                per_dp = batch_size // dp
                # a dp that does not divide the batch stays in: the core's check refuses it
                accums = divisors(per_dp) if per_dp and batch_size % dp == 0 else [1]
                eps = (
                    [e for e in divisors(dp) if n_experts % e == 0]
                    if n_experts and cp == 1
                    else [1]
                )
                for accum, ep in (
                    (a, e)
                    for a in choices("train.grad_accum_steps", accums)
                    for e in choices("parallel.ep", eps)
                ):
                    for strategy in choices("strategy", strategies):
                        for mode in choices(
                            "train.activation_checkpointing", ACTIVATION_CHECKPOINTING
                        ):
                            layouts.append(
                                Layout(
                                    strategy,
                                    dp,
                                    tp,
                                    pp,
                                    max(1, per_dp // accum),
                                    accum,
                                    mode,
                                    cp=cp,
                                    ep=ep,
                                )
                            )
    return layouts


@dataclass
class SearchResult:
    enumerated: int
    over_budget: int
    checked: int
    accepted: list[tuple[Layout, Cost]] = field(default_factory=list)
    estimates: list[tuple[Layout, Cost]] = field(default_factory=list)  # every layout's
    refusals: Counter = field(default_factory=Counter)  # reason, digits as N -> count
    examples: dict[str, str] = field(default_factory=dict)  # one real text per reason

    @property
    def refused(self) -> int:
        return self.checked - len(self.accepted)

    def most_common_refusal(self) -> tuple[str, int] | None:
        if not self.refusals:
            return None
        reason, count = self.refusals.most_common(1)[0]
        return self.examples[reason], count


def layout_config(base: DictConfig, layout: Layout) -> DictConfig:
    cfg = copy.deepcopy(base)
    for override in layout.overrides()[1:]:  # the strategy is the composed base's
        key, _, value = override.partition("=")
        OmegaConf.update(cfg, key, int(value) if value.isdigit() else value)
    return cfg


def search(
    pm: PlaitPluginManager,
    overrides: list[str],
    world_size: int,
    memory_bytes: float,
    work: Workload,
    fixed: dict[str, str],
    top: int,
    strategies: list[str],
) -> SearchResult:
    """The ``top`` fastest layouts that pass the checks (all with ``top=0``), one per strategy
    and mesh: its fastest micro-batch and recompute within the budget."""
    layouts = enumerate_layouts(
        world_size, work.batch_size, fixed, strategies, getattr(work.model, "n_experts", 0)
    )
    costs = [(layout, cost(layout, work)) for layout in layouts]
    fitting = sorted((lc for lc in costs if lc[1].memory_bytes <= memory_bytes), key=rank_key)
    result = SearchResult(len(layouts), len(layouts) - len(fitting), 0, estimates=costs)
    bases: dict[str, DictConfig] = {}
    settled = set()  # (strategy, dp, cp, tp, pp, ep) accepted, or refused whatever its variant
    for layout, estimate in fitting:
        if top and len(result.accepted) == top:
            break
        mesh = (layout.strategy, layout.dp, layout.cp, layout.tp, layout.pp, layout.ep)
        if mesh in settled:
            continue
        if layout.strategy not in bases:
            bases[layout.strategy] = compose_config(overrides + [f"strategy={layout.strategy}"], pm)
        problems = plan_config(layout_config(bases[layout.strategy], layout), (), pm).problems
        result.checked += 1
        if not problems:
            result.accepted.append((layout, estimate))
            settled.add(mesh)
            continue
        reason = re.sub(r"\d+", "N", problems[0])
        result.refusals[reason] += 1
        result.examples.setdefault(reason, problems[0])
        if not any(setting in problem for problem in problems for setting in VARIANT_SETTINGS):
            settled.add(mesh)
    return result


def rank_key(layout_cost: tuple[Layout, Cost]) -> tuple:
    """Fastest estimate first; among equal estimates (the model has no per-kernel efficiency, so
    under pp=1 the micro-batch does not change it) the larger micro-batch, less recompute, then
    less memory."""
    layout, estimate = layout_cost
    return (
        round(estimate.step_s, 12),
        layout.microbatches,
        ACTIVATION_CHECKPOINTING.index(layout.activation_checkpointing),
        estimate.memory_bytes,
    )
