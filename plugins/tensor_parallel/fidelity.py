"""At load, once the model is built and before the first step: do this layout's
tensor-parallel shards compute the model's own forward?

A model that can make a stand-in of itself (``model.stand_in(seed, tp)``, ``model=hf``) has it
split by the same plan over the real tensor-parallel group; each rank runs the stand-in whole and
split on the same seeded tokens, gathers a vocab-parallel head's logits, and compares the logits
and every parameter's gradient (a shard's with its slice of the whole gradient) with
:mod:`plait.engine.fidelity`. The worst difference over the group decides on every rank alike. A
plan that loses or repeats arithmetic (a multiplier applied per shard or never, a gradient one
rank sums alone) stops the run here, before training, naming the family, the layout and the
difference. A model without a stand-in (plait's GPT) is not checked.
"""

from __future__ import annotations

import copy
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from plait.engine.fidelity import TOLERANCE, Difference, one_thread, probe_tokens, run
from plait.engine.tensor_shards import split_tensor
from plait.plugins.tensor_parallel.mappings import gather_from_tensor_model_parallel_region
from plait.plugins.tensor_parallel.plan import TensorParallelPlan, apply_plan


class UnfaithfulLayout(ValueError):
    """A layout that does not compute the model's forward, found before the first step."""


def check_shard_composition(
    cfg, model: nn.Module, plan: TensorParallelPlan | None, topology
) -> Difference | None:
    """Raise :class:`UnfaithfulLayout` when the stand-in split by ``plan`` differs from its
    unsplit forward; the difference found (None: the model has no stand-in)."""
    make = getattr(model, "stand_in", None)
    if make is None or plan is None:
        return None
    started = time.perf_counter()
    group, rank, size = topology.group("tp"), topology.tp_rank, topology.dims.tp
    family = getattr(model, "plait_architecture", type(model).__name__)
    whole = make(cfg.seed, size).to(topology.device)
    split = copy.deepcopy(whole)
    apply_plan(split, plan, group, rank, size, cfg.tensor_parallel.sequence_parallel)
    vocab = next(m for m in whole.modules() if isinstance(m, nn.Embedding)).num_embeddings
    tokens = probe_tokens(vocab, cfg.train.seq_len, cfg.seed, topology.device)
    vocab_parallel = any(getattr(m, "is_vocab_parallel_output", False) for m in split.modules())

    def split_forward(x):
        logits = split(x)
        return gather_from_tensor_model_parallel_region(logits, group) if vocab_parallel else logits

    sharded = {n: p for n, p in split.named_parameters() if getattr(p, "tensor_model_parallel", 0)}

    def expected_grad(name: str, full: torch.Tensor) -> torch.Tensor:
        if name not in sharded:
            return full
        p = sharded[name]
        return split_tensor(full, p.partition_dim, p.partition_stride, rank, size)

    with one_thread():
        difference = Difference.of(
            run(whole, whole, tokens, cfg.seed),
            run(split_forward, split, tokens, cfg.seed),
            expected_grad,
        )
    difference = worst_over(difference, group, topology.device)
    if not difference.faithful:
        raise UnfaithfulLayout(_message(family, size, difference))
    if topology.is_logging_rank:
        print(
            f"plait: {family}'s tensor-parallel shards (parallel.tp={size}) compute its own "
            f"forward on a seeded stand-in: {difference.logits:.1e} in the logits, "
            f"{difference.gradients:.1e} in the gradients ({time.perf_counter() - started:.2f} s)",
            flush=True,
        )
    return difference


def worst_over(difference: Difference, group, device) -> Difference:
    """The largest differences any rank of ``group`` found (every rank then decides alike)."""
    local = [difference.logits, difference.gradients, float(bool(difference.missing))]
    found = torch.tensor(local, device=device)
    dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
    logits, gradients, missing = found.tolist()
    if [logits, gradients, missing] == local:
        return difference
    here = difference.gradients > TOLERANCE or gradients == local[1]
    worst = difference.worst if here else "on another tensor-parallel rank"
    elsewhere = ("on another tensor-parallel rank",) if missing else ()
    return Difference(logits, gradients, worst, difference.missing or elsewhere)


def _message(family: str, tp: int, difference: Difference) -> str:
    return (
        f"parallel.tp={tp}: {family}'s tensor-parallel shards do not compute its own forward: "
        f"on a seeded stand-in of it, split by the same plan over this run's tensor-parallel "
        f"group, the shards differ from the unsplit forward by {difference.describe()}. A plan "
        "entry loses or repeats arithmetic (a multiplier applied per shard or never, a "
        "gradient only one rank sums); refused before the first step: fix "
        "tensor_parallel.plan, or set parallel.tp=1"
    )
