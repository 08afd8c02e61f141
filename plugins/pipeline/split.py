"""Cutting a model into pipeline stages: the balance (how many blocks each stage gets) and the
stage modules themselves. Pure functions of the model; no process group needed except for the
``time`` balance, whose measurement every rank must agree on.

The model is seen as the sequence ``[embed, blocks.0, ..., blocks.{L-1}, norm + head]`` (the
layout of :mod:`plait.plugins.models.gpt`: blocks in a ``ModuleDict``, every part may be None). ``S``
stages each take a contiguous run of ``n_s >= 1`` blocks, ``sum(n_s) = L``; the first stage also
holds ``embed``, the last ``norm`` and ``head``. A balance gives each part a cost ``c`` and picks
the counts that minimise the most expensive stage::

    min over (n_0 .. n_{S-1}) of max_s [s = 0]·c(embed) + sum_{b in s} c(b) + [s = S-1]·c(tail)

- ``layers``: equal block counts (``L mod S`` extra blocks go to the earliest stages); the
  embedding and the head are ignored, as Megatron's uniform split does.
- ``params``: ``c`` = parameter count, so a heavy head (large vocabulary) leaves fewer blocks on
  the last stage.
- ``time``: ``c`` = measured forward + backward seconds of each part on one micro-batch (a short
  profiling pass; the maximum over ranks, so every rank computes the same split).
- ``[n_0, ..., n_{S-1}]``: explicit block counts.
"""

from __future__ import annotations

import copy
import statistics
import time
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn as nn

PARTS_FIRST = ("embed",)
PARTS_LAST = ("norm", "head")
BALANCES = ("layers", "params", "time")


@dataclass(frozen=True)
class StageSplit:
    """Block counts per stage and each stage's cost under the balance that chose them."""

    balance: str
    counts: tuple[int, ...]
    costs: tuple[float, ...]

    def block_ranges(self) -> list[range]:
        ranges, start = [], 0
        for n in self.counts:
            ranges.append(range(start, start + n))
            start += n
        return ranges

    def describe(self, stage_to_rank: Sequence[int]) -> str:
        total = sum(self.costs) or 1.0
        lines = [f"plait: pipeline split over {len(self.counts)} stages (balance={self.balance})"]
        last = len(self.counts) - 1
        for s, blocks in enumerate(self.block_ranges()):
            span = (f"block {blocks.start}" if len(blocks) == 1
                    else f"blocks {blocks.start}-{blocks.stop - 1}")
            parts = (["embed"] if s == 0 else []) + [span]
            parts += ["norm + head"] if s == last else []
            lines.append(f"  stage {s} (pp rank {stage_to_rank[s]}): {' + '.join(parts):28s} "
                         f"{len(blocks)} block(s), {100 * self.costs[s] / total:5.1f}% of "
                         f"{self.unit}")
        return "\n".join(lines)

    @property
    def unit(self) -> str:
        return {"layers": "blocks", "params": "parameters", "time": "measured time"}.get(
            self.balance, "blocks")


def part_modules(model: nn.Module) -> tuple[list[nn.Module | None], list[nn.Module]]:
    """The model's ``[embed]`` and blocks, checking it has the splittable layout."""
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleDict):
        raise ValueError(
            f"parallel.pp>1 needs a model with its layers in a ModuleDict `blocks` and optional "
            f"`embed`, `norm`, `head` parts (plait's GPT layout); {type(model).__name__} has none: "
            "use model=gpt_tiny / gpt2_small or give your model that layout")
    return [getattr(model, "embed", None)], list(blocks.values())


def tail_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in (getattr(model, n, None) for n in PARTS_LAST) if m is not None]


def n_params(modules: Sequence[nn.Module | None]) -> int:
    return sum(p.numel() for m in modules if m is not None for p in m.parameters())


def min_max_partition(first: float, blocks: Sequence[float], last: float, n_stages: int
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


def stage_costs(first: float, blocks: Sequence[float], last: float, counts: Sequence[int]
                ) -> tuple[float, ...]:
    costs, start = [], 0
    for s, n in enumerate(counts):
        c = sum(blocks[start:start + n]) + (first if s == 0 else 0)
        costs.append(c + (last if s == len(counts) - 1 else 0))
        start += n
    return tuple(costs)


def check_counts(counts: Sequence[int], n_layers: int, n_stages: int) -> None:
    if len(counts) != n_stages or sum(counts) != n_layers or min(counts) < 1:
        raise ValueError(
            f"pipeline.balance={list(counts)} must list {n_stages} block counts (one per pipeline "
            f"stage), each at least 1, adding up to the model's {n_layers} blocks")


def split_stages(model: nn.Module, n_stages: int, balance, part_times=None) -> StageSplit:
    """Choose the block counts of ``n_stages`` stages by ``balance`` (see the module docstring).

    :param part_times: for ``balance="time"``, the seconds of ``[embed, *blocks, tail]``
        (from :func:`measure_part_times`).
    """
    (embed,), blocks = part_modules(model)
    L = len(blocks)
    if n_stages > L:
        raise ValueError(f"{n_stages} pipeline stages need at least {n_stages} blocks, the model "
                         f"has {L}: lower parallel.pp (x pipeline.virtual_stages)")
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
        first, costs, last = float(n_params([embed])), [float(n_params([b])) for b in blocks], \
            float(n_params(tail_modules(model)))
    elif balance == "time":
        if part_times is None or len(part_times) != L + 2:
            raise ValueError("balance=time needs the measured time of every part")
        first, *costs, last = part_times
    else:
        raise ValueError(f"pipeline.balance={balance!r}: choose one of {', '.join(BALANCES)} or a "
                         "list of block counts per stage")
    counts = min_max_partition(first, costs, last, n_stages)
    return StageSplit(balance, counts, stage_costs(first, costs, last, counts))


def measure_part_times(model: nn.Module, sample: torch.Tensor, repeats: int = 3) -> list[float]:
    """Forward + backward seconds of ``[embed, *blocks, norm + head]`` on ``sample`` (token ids).

    Each part runs on a detached copy of its input so its backward is timed alone; the median of
    ``repeats`` runs after one warm-up is kept. Parts are timed one after the other, so a model on
    the meta device is given memory one part at a time (:func:`timing_copy`).
    """
    (embed,), blocks = part_modules(model)
    tail = nn.Sequential(*tail_modules(model))
    seconds, x = [], sample
    for part in (embed, *blocks, tail):
        part = timing_copy(part)
        runs = []
        for repeat in range(repeats + 1):
            x_in = x.detach().requires_grad_(x.is_floating_point())
            started = time.perf_counter()
            y = part(x_in) if part is not None else x_in
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


class PipelineStageModules(nn.Module):
    """This rank's pipeline chunks under the unsplit model's parameter names.

    The parts (``embed``, ``blocks.<i>``, ``norm``, ``head``) are registered here once, so
    ``state_dict()`` keeps the original names (``plait export`` unites the stages' disjoint names)
    and the optimizer sees every local parameter once. ``chunks`` lists ``(stage_index, module)``
    for the pipeline schedule; each chunk is a shell of the model sharing these parts.
    """

    def __init__(self, chunks: list[tuple[int, nn.Module]], n_stages: int):
        super().__init__()
        self.n_stages = n_stages
        self.blocks = nn.ModuleDict()
        for _, chunk in chunks:
            for name, child in chunk.named_children():
                if name == "blocks":
                    self.blocks.update(child)
                elif child is not None:
                    self.add_module(name, child)
        self.chunks = chunks  # a plain list: the parts are registered above, once


def build_stage_modules(model: nn.Module, split: StageSplit, stage_indices: Sequence[int]
                        ) -> PipelineStageModules:
    """Cut ``model`` in place into the chunks for ``stage_indices``; blocks of other stages are
    dropped (freed)."""
    (embed,), _ = part_modules(model)
    blocks = model.blocks
    tail = {name: getattr(model, name, None) for name in PARTS_LAST}
    for name in (*PARTS_FIRST, *PARTS_LAST):
        if hasattr(model, name):
            setattr(model, name, None)
    model.blocks = nn.ModuleDict()
    keys = list(blocks.keys())
    ranges = split.block_ranges()
    last = len(split.counts) - 1
    chunks = []
    for s in stage_indices:
        chunk = copy.deepcopy(model)  # the emptied shell: no parameters of its own
        chunk.blocks = nn.ModuleDict({keys[i]: blocks[keys[i]] for i in ranges[s]})
        if s == 0 and embed is not None:
            chunk.embed = embed
        if s == last:
            for name, part in tail.items():
                if part is not None:
                    setattr(chunk, name, part)
        chunks.append((s, chunk))
    return PipelineStageModules(chunks, len(split.counts))
