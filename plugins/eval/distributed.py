"""Scoring during training, data-parallel, with the model as it is sharded.

The logging rank runs the harness. Each time the harness asks for scores it broadcasts the
items to every trainer; each data-parallel replica (all its tensor-parallel and pipeline ranks
together) scores every ``dp``-th item through the engine's ``eval_loss`` with the run's loss
armed (:class:`~.scoring.ScoringLoss`), the ranks that hold the logits (the last pipeline stage,
tensor-parallel rank 0) keep the scores, and the logging rank gathers them. No rank ever holds
more of the model than training gave it.

Every replica runs the same number of batches (the shortest share is padded with rows of
padding), so the collectives inside the forward (the dp loss reduction, ZeRO-3 and FSDP gathers,
expert all-to-alls) match up.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch.distributed as dist

from plait.plugins.eval.scoring import Item, Scores, ScoringLoss, make_batch, split_rows
from plait.topology import Topology
from plait.types import Engine


class EngineScorer:
    """``score(items)`` on the logging rank; ``follow()`` on every other trainer until the
    logging rank's ``finish()``."""

    def __init__(
        self, engine: Engine, loss: ScoringLoss, topology: Topology, batch_size: int, length: int
    ):
        self.engine, self.loss = engine, loss
        self.batch_size, self.length = batch_size, length
        self.group = topology.trainer_group  # None: the default group (every rank trains)
        self.leader = topology.trainer_ranks[0]
        self.is_leader = topology.rank == self.leader
        self.world = len(topology.trainer_ranks)
        self.dp, self.dp_rank = topology.dims.dp, topology.dp_rank
        self.keeps_scores = topology.tp_rank == 0  # one copy of a vocab-parallel head's scores

    def score(self, items: Sequence[Item]) -> list[Scores]:
        dist.broadcast_object_list([list(items)], src=self.leader, group=self.group)
        return self._score_share(list(items))

    def follow(self) -> None:
        while True:
            job = [None]
            dist.broadcast_object_list(job, src=self.leader, group=self.group)
            if job[0] is None:
                return
            self._score_share(job[0])

    def finish(self) -> None:
        dist.broadcast_object_list([None], src=self.leader, group=self.group)

    def _score_share(self, items: list[Item]) -> list[Scores]:
        """This replica's share (items ``dp_rank, dp_rank + dp, ...``) scored; on the logging
        rank every item's scores, gathered from the replicas."""
        mine = list(range(self.dp_rank, len(items), self.dp))
        batches = math.ceil(math.ceil(len(items) / self.dp) / self.batch_size)
        scored: dict[int, Scores] = {}
        for b in range(batches):
            indices = mine[b * self.batch_size : (b + 1) * self.batch_size]
            chunk = [items[i] for i in indices]
            batch = make_batch(chunk, self.batch_size, self.length)
            captured = self.loss.capture(lambda: self.engine.eval_loss(batch))
            if captured and self.keeps_scores:
                scored.update(zip(indices, split_rows(chunk, *captured[0])))
        gathered = [None] * self.world if self.is_leader else None
        dist.gather_object(scored, gathered, dst=self.leader, group=self.group)
        if not self.is_leader:
            return []
        merged = {i: s for part in gathered for i, s in part.items()}
        return [merged[i] for i in range(len(items))]
