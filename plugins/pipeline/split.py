"""Cutting a model into pipeline stages: the balance (how many layers each stage gets) and the
stage modules themselves. Pure functions of the model; no process group needed except for the
``time`` balance, whose measurement every rank must agree on.

Which parts go where is the model's *pipeline plan* (:class:`PipelinePlan`): ``first`` (parts
the first stage holds: embeddings), ``layers`` (the name of a ``ModuleList`` or ``ModuleDict`` of
repeated layers), ``last`` (the last stage's: final norm, head). plait's GPT declares
``pipeline_plan = {"first": ["embed"], "layers": "blocks", "last": ["norm", "head"]}``; a
Hugging Face model's comes from its config's ``base_model_pp_plan`` (``model=hf``); any other
module gets one from ``pipeline.layers=<name>`` (:func:`plan_from_layers`). The model is seen as
the sequence ``[first, layers.0, ..., layers.{L-1}, last]``. ``S`` stages each take a contiguous
run of ``n_s >= 1`` layers, ``sum(n_s) = L``; the first stage also holds ``first``, the last
``last``. A balance gives each part a cost ``c`` and picks the counts that minimise the most
expensive stage::

    min over (n_0 .. n_{S-1}) of max_s [s = 0]·c(first) + sum_{b in s} c(b) + [s = S-1]·c(last)

- ``layers``: equal layer counts (``L mod S`` extra layers go to the earliest stages); the
  embedding and the head are ignored, as Megatron's uniform split does.
- ``params``: ``c`` = parameter count, so a heavy head (large vocabulary) leaves fewer layers on
  the last stage.
- ``time``: ``c`` = measured forward + backward seconds of each part on one micro-batch (a short
  profiling pass; the maximum over ranks, so every rank computes the same split).
- ``[n_0, ..., n_{S-1}]``: explicit layer counts.

A stage is the whole model holding only its parts, so the model's own forward runs on every
stage: its layer list keeps only the stage's layers under their original indices (a loop over it
visits those; with the plan's ``identities_for_other_layers``, as for ``transformers`` models, it
meets a :class:`~plait.engine.stages.StageIdentity` in each other stage's layer's place, so a
forward that looks a layer's settings up by its index sees the right ones), and the first and
last parts of other stages are identities, which pass their input on, so a later stage's input
(hidden states) flows through in place of the embedding, as ``transformers``' pipeline does and
torchtitan's models do with ``None`` parts. A
model cut by ``pipeline.layers`` must therefore pass a later stage's input through its first parts
unchanged (a forward that adds position embeddings to the token embeddings does not); a model
that knows it cannot be cut says why in ``no_pipeline_plan_reason``.
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
import time
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn as nn

from plait.engine.stages import PipelineStageModules, StageIdentity, StageLayerList

BALANCES = ("layers", "params", "time")


@dataclass(frozen=True)
class PipelinePlan:
    """Which modules of a model each pipeline stage holds (module names in the unsplit model).

    ``layers_run_alone``: each part can be called on the previous part's output alone (the
    ``time`` balance times them that way); False for layers that take more from the model's
    forward (a Hugging Face decoder layer takes the rotary embedding and the mask).
    ``identities_for_other_layers``: a stage's forward meets an identity in the place of each
    layer another stage holds (its layers return the whole hidden state, and the forward may
    look a layer's settings up by its index: ``transformers``' decoder layers), instead of
    skipping them (a layer that returns its residual branch); a model asks for it with the
    attribute ``pipeline_identities_for_other_layers = True``.
    """

    first: tuple[str, ...]
    layers: str
    last: tuple[str, ...]
    layers_run_alone: bool = True
    identities_for_other_layers: bool = False

    @classmethod
    def of(cls, plan) -> PipelinePlan:
        """From a model's ``pipeline_plan`` dict (``first``, ``layers``, ``last``)."""
        return cls(
            tuple(plan.get("first", ())),
            plan["layers"],
            tuple(plan.get("last", ())),
            plan.get("layers_run_alone", True),
        )


def plan_from_layers(model: nn.Module, layers: str) -> PipelinePlan:
    """The plan of a model named only by its layer list (``pipeline.layers=<name>``): the
    modules holding parameters that are registered before the layer list (walking down to it)
    go to the first stage, those after it to the last; modules without parameters stay on
    every stage."""
    first, last = [], []
    prefix, parent = "", model
    for part in layers.split("."):
        names = [name for name, _ in parent.named_children()]
        if part not in names:
            raise ValueError(
                f"pipeline.layers={layers}: {type(parent).__name__} "
                f"{prefix.rstrip('.') or '(the model)'} has no child {part!r}; "
                f"it has {names}"
            )
        before = True
        for name, child in parent.named_children():
            if name == part:
                before = False
            elif any(True for _ in child.parameters()):
                (first if before else last).append(prefix + name)
        prefix, parent = prefix + part + ".", parent.get_submodule(part)
    return PipelinePlan(tuple(first), layers, tuple(last))


def model_plan(model: nn.Module, layers: str | None = None) -> PipelinePlan | None:
    """``pipeline.layers`` when given, else the model's own ``pipeline_plan``; None when there
    is neither."""
    if layers:
        return plan_from_layers(model, layers)
    plan = getattr(model, "pipeline_plan", None)
    if plan is None:
        return None
    identities = bool(getattr(model, "pipeline_identities_for_other_layers", False))
    return dataclasses.replace(PipelinePlan.of(plan), identities_for_other_layers=identities)


def required_plan(model: nn.Module) -> PipelinePlan:
    plan = model_plan(model)
    if plan is None:
        raise ValueError(
            f"parallel.pp>1 needs a pipeline plan: {type(model).__name__} has no "
            "pipeline_plan; name its layer list with pipeline.layers=<module name>"
        )
    return plan


@dataclass(frozen=True)
class StageSplit:
    """Layer counts per stage and each stage's cost under the balance that chose them."""

    balance: str
    counts: tuple[int, ...]
    costs: tuple[float, ...]

    def block_ranges(self) -> list[range]:
        ranges, start = [], 0
        for n in self.counts:
            ranges.append(range(start, start + n))
            start += n
        return ranges

    def describe(self, stage_to_rank: Sequence[int], plan: PipelinePlan | None = None) -> str:
        total = sum(self.costs) or 1.0
        first = " + ".join(plan.first) if plan and plan.first else "embed"
        last_parts = " + ".join(plan.last) if plan and plan.last else "norm + head"
        lines = [f"plait: pipeline split over {len(self.counts)} stages (balance={self.balance})"]
        last = len(self.counts) - 1
        for s, blocks in enumerate(self.block_ranges()):
            span = (
                f"layer {blocks.start}"
                if len(blocks) == 1
                else f"layers {blocks.start}-{blocks.stop - 1}"
            )
            parts = ([first] if s == 0 else []) + [span]
            parts += [last_parts] if s == last else []
            lines.append(
                f"  stage {s} (pp rank {stage_to_rank[s]}): {' + '.join(parts):28s} "
                f"{len(blocks)} layer(s), {100 * self.costs[s] / total:5.1f}% of "
                f"{self.unit}"
            )
        return "\n".join(lines)

    @property
    def unit(self) -> str:
        return {"layers": "layers", "params": "parameters", "time": "measured time"}.get(
            self.balance, "layers"
        )


def layer_container(model: nn.Module, plan: PipelinePlan) -> nn.ModuleList | nn.ModuleDict:
    try:
        container = model.get_submodule(plan.layers)
    except AttributeError:
        container = None
    if not isinstance(container, (nn.ModuleList, nn.ModuleDict)):
        raise ValueError(
            f"the pipeline plan's layers {plan.layers!r} is not a ModuleList or "
            f"ModuleDict of {type(model).__name__}: name the model's layer list "
            "with pipeline.layers=<module name>"
        )
    return container


def layer_keys(container: nn.ModuleList | nn.ModuleDict) -> list[str]:
    return (
        list(container.keys())
        if isinstance(container, nn.ModuleDict)
        else [str(i) for i in range(len(container))]
    )


def part_modules(
    model: nn.Module, plan: PipelinePlan
) -> tuple[list[nn.Module], list[nn.Module], list[nn.Module]]:
    """The model's first parts, its layers and its last parts."""
    container = layer_container(model, plan)
    layers = [
        container[k] if isinstance(container, nn.ModuleDict) else container[int(k)]
        for k in layer_keys(container)
    ]
    return (
        [model.get_submodule(n) for n in plan.first],
        layers,
        [model.get_submodule(n) for n in plan.last],
    )


def n_params(modules: Sequence[nn.Module | None]) -> int:
    return sum(p.numel() for m in modules if m is not None for p in m.parameters())


def min_max_partition(
    first: float, blocks: Sequence[float], last: float, n_stages: int
) -> tuple[int, ...]:
    """Block counts minimising the most expensive stage (dynamic programming, O(S·L²)).

    ``best[s][i]``: the lowest possible maximum stage cost when stages ``0..s`` hold blocks
    ``0..i-1``. Ties keep the earliest cut, so the split is deterministic.
    """
    L = len(blocks)
    prefix = [0.0]
    for c in blocks:
        prefix.append(prefix[-1] + c)

    def cost(s: int, i: int, j: int) -> float:  # stage s holds blocks i..j-1
        ends = (first if s == 0 else 0) + (last if s == n_stages - 1 else 0)
        return prefix[j] - prefix[i] + ends

    inf = float("inf")
    best = [[inf] * (L + 1) for _ in range(n_stages)]
    cut = [[0] * (L + 1) for _ in range(n_stages)]
    for j in range(1, L + 1):
        best[0][j] = cost(0, 0, j)
    for s in range(1, n_stages):
        for j in range(s + 1, L + 1):
            for i in range(s, j):
                value = max(best[s - 1][i], cost(s, i, j))
                if value < best[s][j]:
                    best[s][j], cut[s][j] = value, i
    counts, j = [], L
    for s in range(n_stages - 1, 0, -1):
        i = cut[s][j]
        counts.append(j - i)
        j = i
    counts.append(j)
    return tuple(reversed(counts))


def stage_costs(
    first: float, blocks: Sequence[float], last: float, counts: Sequence[int]
) -> tuple[float, ...]:
    costs, start = [], 0
    for s, n in enumerate(counts):
        c = sum(blocks[start : start + n]) + (first if s == 0 else 0)
        costs.append(c + (last if s == len(counts) - 1 else 0))
        start += n
    return tuple(costs)


def check_counts(counts: Sequence[int], n_layers: int, n_stages: int) -> None:
    if len(counts) != n_stages or sum(counts) != n_layers or min(counts) < 1:
        raise ValueError(
            f"pipeline.balance={list(counts)} must list {n_stages} layer counts (one per pipeline "
            f"stage), each at least 1, adding up to the model's {n_layers} layers"
        )


def split_stages(
    model: nn.Module, n_stages: int, balance, part_times=None, plan: PipelinePlan | None = None
) -> StageSplit:
    """Choose the layer counts of ``n_stages`` stages by ``balance`` (see the module docstring).

    :param part_times: for ``balance="time"``, the seconds of ``[first, *layers, last]``
        (from :func:`measure_part_times`).
    :param plan: the pipeline plan; the model's own when None.
    """
    first, blocks, last = part_modules(model, plan or required_plan(model))
    L = len(blocks)
    if n_stages > L:
        raise ValueError(
            f"{n_stages} pipeline stages need at least {n_stages} layers, the model "
            f"has {L}: lower parallel.pp (x pipeline.virtual_stages)"
        )
    if not isinstance(balance, str):
        counts = tuple(int(n) for n in balance)
        check_counts(counts, L, n_stages)
        ones = [1.0] * L
        return StageSplit("explicit", counts, stage_costs(0, ones, 0, counts))
    if balance == "layers":
        q, r = divmod(L, n_stages)
        counts = tuple(q + (s < r) for s in range(n_stages))
        return StageSplit("layers", counts, stage_costs(0, [1.0] * L, 0, counts))
    if balance == "params":
        first_cost, costs, last_cost = (
            float(n_params(first)),
            [float(n_params([b])) for b in blocks],
            float(n_params(last)),
        )
    elif balance == "time":
        if part_times is None or len(part_times) != L + 2:
            raise ValueError("balance=time needs the measured time of every part")
        first_cost, *costs, last_cost = part_times
    else:
        raise ValueError(
            f"pipeline.balance={balance!r}: choose one of {', '.join(BALANCES)} or a "
            "list of layer counts per stage"
        )
    counts = min_max_partition(first_cost, costs, last_cost, n_stages)
    return StageSplit(balance, counts, stage_costs(first_cost, costs, last_cost, counts))


def measure_part_times(
    model: nn.Module, sample: torch.Tensor, repeats: int = 3, plan: PipelinePlan | None = None
) -> list[float]:
    """Forward + backward seconds of ``[first, *layers, last]`` on ``sample`` (token ids).

    Each part runs on a detached copy of its input so its backward is timed alone; the median of
    ``repeats`` runs after one warm-up is kept. Parts are timed one after the other, so a model on
    the meta device is given memory one part at a time (:func:`timing_copy`).
    """
    first, blocks, last = part_modules(model, plan or required_plan(model))
    seconds, x = [], sample
    for part in (nn.Sequential(*first), *blocks, nn.Sequential(*last)):
        part = timing_copy(part)
        runs = []
        for repeat in range(repeats + 1):
            x_in = x.detach().requires_grad_(x.is_floating_point())
            started = time.perf_counter()
            y = part(x_in)
            if y.requires_grad:
                y.backward(torch.ones_like(y))
            if repeat:
                runs.append(time.perf_counter() - started)
        seconds.append(statistics.median(runs))
        x = y.detach()
    model.zero_grad(set_to_none=True)
    return seconds


def timing_copy(part: nn.Module | None) -> nn.Module | None:
    """``part`` itself, or for a part still on the meta device (a model initialised by name,
    :mod:`plait.meta`) a copy on the CPU with random values: time does not depend on them."""
    if part is None or not any(p.is_meta for p in part.parameters()):
        return part
    copy_ = copy.deepcopy(part).to_empty(device="cpu")
    with torch.no_grad():
        for p in copy_.parameters():
            p.normal_(0.0, 0.02)
    return copy_


def stage_layers(
    container: nn.ModuleList | nn.ModuleDict, layers: dict[str, nn.Module], plan: PipelinePlan
) -> nn.Module:
    """The container of one stage's layers, of the whole list's kind."""
    if isinstance(container, nn.ModuleDict):
        return nn.ModuleDict(layers)
    return StageLayerList(layers, len(container), plan.identities_for_other_layers)


def _set(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    holder = model.get_submodule(parent) if parent else model
    if isinstance(holder, nn.ModuleList):
        holder[int(child)] = module
    else:
        setattr(holder, child, module)


def build_stage_modules(
    model: nn.Module,
    split: StageSplit,
    stage_indices: Sequence[int],
    plan: PipelinePlan | None = None,
) -> PipelineStageModules:
    """Cut ``model`` in place into the chunks for ``stage_indices``; the parts of other stages
    are dropped (freed). ``plan``: the model's own when None."""
    plan = plan or required_plan(model)
    first, layers, last = part_modules(model, plan)
    container = layer_container(model, plan)
    keys = layer_keys(container)
    for name in (*plan.first, *plan.last):
        _set(model, name, StageIdentity())
    _set(model, plan.layers, stage_layers(container, {}, plan))
    ranges = split.block_ranges()
    final = len(split.counts) - 1

    def holding(stages: Sequence[int]) -> nn.Module:
        shell = copy.deepcopy(model)  # the stripped model: no parameters of its own
        held = sorted(i for s in stages for i in ranges[s])
        layers_held = {keys[i]: layers[i] for i in held}
        _set(shell, plan.layers, stage_layers(container, layers_held, plan))
        for s in stages:
            if s == 0:
                for name, part in zip(plan.first, first):
                    _set(shell, name, part)
            if s == final:
                for name, part in zip(plan.last, last):
                    _set(shell, name, part)
        return shell

    chunks = [(s, holding([s])) for s in stage_indices]
    return PipelineStageModules(holding(stage_indices), chunks, len(split.counts))
