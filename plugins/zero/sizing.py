"""DeepSpeed's working memory sized from the model, not from its GPU defaults.

DeepSpeed sizes its buffers for billion-parameter models on GPUs: reduce and all-gather buckets of
5·10⁸ elements (2 GB in fp32), ZeRO-3 prefetch of 5·10⁷ and up to 10⁹ live gathered elements kept
while they may be reused within 10⁹ elements, and an optimizer step over sub-groups of 10⁹
elements. For any model below that size these mean "the whole model": ZeRO-3 keeps every
gathered parameter between forward and backward, the gradient bucket holds every gradient, and
the step copies the rank's whole gradient partition flat and has torch's AdamW make temporaries
of its size. So ZeRO fitted a *smaller* model than DDP (bench_memory). plait sets each from the
number of elements ``Ψ`` this rank's part of the model has and its largest parameter ``P`` (both
counted on the unsplit model built on the meta device, divided by tp·pp, so ``plait plan`` shows
the config the engine gets)::

    bucket B = min(max(Ψ / 32, P), 5·10⁸)       # a few percent of the model, at least one
                                                 # parameter, at most DeepSpeed's default
    stage 1-2:  reduce_bucket_size = allgather_bucket_size = B
    stage 3:    reduce_bucket_size = stage3_prefetch_bucket_size = B,
                stage3_max_live_parameters = stage3_max_reuse_distance = 2·B
                (gathered parameters are released unless reused within two buckets)
    stage 1-3:  sub_group_size = max(B, 2²¹)     # the optimizer steps that many at a time

``sub_group_size`` is DeepSpeed's ZeRO-3 setting: the rank's partition is stepped in sub-groups of
that many elements, each with its own flat gradient copy and AdamW temporaries (``3·sub_group_size``
elements at most, where the whole partition made ``3Ψ/N``). DeepSpeed's ZeRO-1/2 have no sub-groups;
they step one flat partition per parameter group, so plait gives them parameter groups of at most
``N·sub_group_size`` elements (:func:`param_groups_within`: the same weight decay, consecutive
parameters, each group partitioned over the N dp ranks as before), which bounds the same copy and
temporaries, and the start-up flattening, to one group at a time. AdamW is elementwise, so the steps
are the same numbers; only the grad norm's sum runs over more groups (in fp64). Each group costs
DeepSpeed a norm all-reduce, an all-gather and a Python pass every step, so sub-groups are never
smaller than 2²¹ elements (24 MiB of step temporaries in fp32): at 3.2M parameters B's 262,144 made
8 groups where the plain loop has 2, 7% of zero2's step (docs/benchmarks.md), and no model of issue
20's 4 GiB table has a smaller B but zero1 x pp2 (1.73M at its 35 layers; it still fits). DeepSpeed
all-reduces each group's norm over the model-parallel ranks (every pipeline stage and tensor shard),
so those ranks must have as many groups: a stage with fewer is cut further (:func:`split_to_count`;
pipeline stages of 12 and 11 layers had deadlocked in the first step). DeepSpeed's checkpoint files
hold the groups, so a checkpoint written with another ``sub_group_size`` (an earlier plait's ``B``)
loads from its layout-free copy (``ZeroEngine.own_files_mismatch``).

Measured (25.5M-parameter GPT, dp=4, fp32, CPU): ZeRO-3's peak above the pre-model memory falls
from 632 to ~400 MiB with the buckets. Any of these keys in ``strategy.deepspeed.zero_optimization``
or ``strategy.config_file`` replaces plait's value; ``comm.bucket_mb`` sets ``reduce_bucket_size``.
"""

from __future__ import annotations

from typing import Any

import torch

DEEPSPEED_DEFAULT_BUCKET = 500_000_000
BUCKETS_PER_MODEL = 32
MIN_SUB_GROUP = 1 << 21


def bucket_elements(model: torch.nn.Module, model_parallel: int) -> int:
    """``B`` above for ``model`` (unsplit, any device) cut into ``model_parallel`` = tp·pp parts."""
    sizes = [p.numel() for p in model.parameters()]
    if not sizes:
        return 0
    local = sum(sizes) // model_parallel
    return int(min(max(local // BUCKETS_PER_MODEL, max(sizes)), DEEPSPEED_DEFAULT_BUCKET))


def working_memory_settings(
    model: torch.nn.Module, stage: int, model_parallel: int
) -> dict[str, Any]:
    """The ``zero_optimization`` keys above for ``model`` (unsplit, any device) cut into
    ``model_parallel`` = tp·pp parts."""
    bucket = bucket_elements(model, model_parallel)
    if stage == 0 or not bucket:
        return {}
    sub_group = max(bucket, MIN_SUB_GROUP)
    if stage < 3:
        return {
            "reduce_bucket_size": bucket,
            "allgather_bucket_size": bucket,
            "sub_group_size": sub_group,
        }
    return {
        "reduce_bucket_size": bucket,
        "stage3_prefetch_bucket_size": bucket,
        "stage3_max_live_parameters": 2 * bucket,
        "stage3_max_reuse_distance": 2 * bucket,
        "sub_group_size": sub_group,
    }


def param_groups_within(groups: list[dict[str, Any]], max_elements: int) -> list[dict[str, Any]]:
    """``groups`` (torch param groups) cut into groups of consecutive parameters holding at most
    ``max_elements`` elements each (a larger parameter alone), every other key kept: ZeRO-1/2's
    sub-groups. Empty groups are dropped, as DeepSpeed drops them."""
    split = []
    for group in groups:
        run: list[torch.nn.Parameter] = []
        size = 0
        for p in group["params"]:
            if run and size + p.numel() > max_elements:
                split.append({**group, "params": run})
                run, size = [], 0
            run.append(p)
            size += p.numel()
        if run:
            split.append({**group, "params": run})
    return split


def split_to_count(groups: list[dict[str, Any]], count: int) -> list[dict[str, Any]]:
    """``groups`` with the largest cut in two at a parameter boundary (halving its elements as
    nearly as the parameters allow) until there are ``count``: the same number of ZeRO-1/2
    sub-groups on every model-parallel rank, none larger than before. A group of one parameter
    is not cut; ``ValueError`` when no group can be."""
    groups = list(groups)
    while len(groups) < count:
        cuttable = [g for g in groups if len(g["params"]) > 1]
        if not cuttable:
            raise ValueError(f"cannot cut {len(groups)} parameter groups into {count}")
        largest = max(cuttable, key=lambda g: sum(p.numel() for p in g["params"]))
        sizes = [p.numel() for p in largest["params"]]
        at = min(range(1, len(sizes)), key=lambda k: max(sum(sizes[:k]), sum(sizes[k:])))
        i = next(k for k, g in enumerate(groups) if g is largest)
        groups[i : i + 1] = [
            {**largest, "params": largest["params"][:at]},
            {**largest, "params": largest["params"][at:]},
        ]
    return groups
