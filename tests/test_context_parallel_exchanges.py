"""Context parallelism's exchanges counted where they leave the process, at ``torch.distributed``
(as ``inhouse.WireRecorder`` does for the comm plugins), not by the counter its own code
increments (``ExchangeStats``, which a fallback could keep incrementing); and the layout the
plugin gives ring attention balanced, whatever layout the exchange tests build themselves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from plait.plugins.context_parallel.apply import layout_for
from plait.plugins.context_parallel.ring import ExchangeStats, RingAttention, plan_tiles
from plait.plugins.context_parallel.ulysses import ulysses_attention
from plait.plugins.models.gpt import CoreAttention
from plait.testing import spawn

SEQ, CP = 32, 2
BACKENDS = ("ring", "ulysses")


class CollectiveRecorder:
    """Counts what this process hands to ``torch.distributed``'s collectives and point-to-point
    batches, by replacing the functions context parallelism looks up at each call: sends in
    ``batch_isend_irecv`` (count, bytes), ``all_to_all`` (calls, bytes to other ranks) and the
    all-gathers a fallback would use."""

    NAMES = ("batch_isend_irecv", "all_to_all", "all_gather", "all_gather_into_tensor")

    def __init__(self):
        self.counts = dict.fromkeys(
            ("sends", "send_bytes", "all_to_all", "all_to_all_bytes", "all_gather"), 0
        )
        self.originals = {name: getattr(dist, name) for name in self.NAMES}

    def __enter__(self):
        originals, counts = self.originals, self.counts

        def batch_isend_irecv(ops):
            for op in ops:
                if op.op is originals_isend:
                    counts["sends"] += 1
                    counts["send_bytes"] += op.tensor.numel() * op.tensor.element_size()
            return originals["batch_isend_irecv"](ops)

        def all_to_all(outputs, inputs, group=None, **kwargs):
            counts["all_to_all"] += 1
            mine = dist.get_rank(group)
            counts["all_to_all_bytes"] += sum(
                t.numel() * t.element_size() for i, t in enumerate(inputs) if i != mine
            )
            return originals["all_to_all"](outputs, inputs, group=group, **kwargs)

        def gathering(name):
            def gather(*args, **kwargs):
                counts["all_gather"] += 1
                return originals[name](*args, **kwargs)

            return gather

        originals_isend = dist.isend
        dist.batch_isend_irecv, dist.all_to_all = batch_isend_irecv, all_to_all
        dist.all_gather = gathering("all_gather")
        dist.all_gather_into_tensor = gathering("all_gather_into_tensor")
        return self

    def __exit__(self, *exc):
        for name, function in self.originals.items():
            setattr(dist, name, function)


def _exchanges(rank: int, world: int, out: str) -> None:
    """One attention forward and backward per backend over the 2 ranks, fp64, recorded."""
    torch.manual_seed(1)
    q, k, v, grad = (torch.randn(2, 4, SEQ, 8, dtype=torch.float64) for _ in range(4))
    results = {}
    for backend in BACKENDS:
        layout = layout_for(backend, SEQ, world, rank)
        index = layout.index()
        mine = [t[:, :, index].clone().requires_grad_() for t in (q, k, v)]
        with CollectiveRecorder() as wire:
            if backend == "ring":
                attended = RingAttention.apply(
                    *mine, None, layout, dist.group.WORLD, 8**-0.5, ExchangeStats()
                )
            else:
                attended = ulysses_attention(
                    CoreAttention(0.0), *mine, None, dist.group.WORLD, ExchangeStats()
                )
            attended.backward(grad[:, :, index])
        kv = 2 * mine[0].numel() * mine[0].element_size()  # this rank's keys and values
        results[backend] = {**wire.counts, "kv": kv}
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("cp_wire")
    spawn(_exchanges, CP, str(out))
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(CP)]


@pytest.mark.slow
def test_ring_attention_sends_its_keys_and_values_point_to_point(recorded):
    """Forward ``C - 1`` sends of this rank's keys and values, backward ``C - 1`` of them and
    ``C`` of their gradients: ``3C - 2`` sends of ``kv`` bytes each, and no gather."""
    for rank in recorded:
        ring = rank["ring"]
        assert ring["sends"] == 3 * CP - 2
        assert ring["send_bytes"] == (3 * CP - 2) * ring["kv"]
        assert ring["all_gather"] == ring["all_to_all"] == 0


@pytest.mark.slow
def test_ulysses_runs_eight_all_to_alls(recorded):
    """q, k, v and the output forward, their gradients backward: 8 all-to-alls, each sending
    ``(C - 1) / C`` of a tensor the size of this rank's keys (half of ``kv``)."""
    for rank in recorded:
        ulysses = rank["ulysses"]
        assert ulysses["all_to_all"] == 8
        assert ulysses["all_to_all_bytes"] == 8 * (CP - 1) / CP * ulysses["kv"] / 2
        assert ulysses["all_gather"] == ulysses["sends"] == 0


@pytest.mark.parametrize("size", [2, 4, 8])
def test_the_plugins_ring_layout_balances_causal_attention(size):
    """``layout_for("ring")``, what the plugin cuts sequences with, gives every rank the same
    number of causal query-key pairs (zigzag chunks) within 10%; contiguous chunks would give
    the last rank ``2C - 1`` times the first's."""
    seq = 32 * size
    pairs = []
    for rank in range(size):
        layout = layout_for("ring", seq, size, rank)
        pairs.append(
            sum(
                tile.pairs(layout.chunk_len)
                for owner in range(size)
                for tile in plan_tiles(layout, owner, None)
            )
        )
    assert min(pairs) > 0 and max(pairs) / min(pairs) <= 1.10, pairs
