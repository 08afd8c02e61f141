"""Data sharding: each data-parallel rank reads a disjoint, deterministic share of each batch.

Per epoch the sample order is a permutation seeded by ``seed + epoch`` (or the plain order with
``data.shuffle=false``). Step ``s`` takes the global batch ``order[s*B:(s+1)*B]``; data-parallel
rank ``r`` of ``dp`` takes the ``r``-th contiguous slice of it and cuts that into
``grad_accum_steps`` micro-batches. So one process with ``grad_accum_steps = dp * k`` sees the same
global batch as ``dp`` processes with ``k`` each, and pipeline / tensor-parallel peers (same
``dp_rank``) read the same samples. The state is ``(epoch, position)``, saved with every
checkpoint.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping

import numpy as np
from omegaconf import OmegaConf

from plait import hookimpl
from plait.types import PluginInfo


class ShardedBatchSampler:
    def __init__(self, n_samples: int, global_batch_size: int, grad_accum_steps: int,
                 dp_rank: int, dp_size: int, shuffle: bool, seed: int):
        self.steps_per_epoch = n_samples // global_batch_size
        if self.steps_per_epoch < 1:
            raise ValueError(
                f"the data holds {n_samples} samples, fewer than one global batch of "
                f"train.batch_size={global_batch_size}: lower train.batch_size or add data"
            )
        self.global_batch_size = global_batch_size
        self.grad_accum_steps = grad_accum_steps
        self.local_batch_size = global_batch_size // dp_size
        self.micro_batch_size = self.local_batch_size // grad_accum_steps
        self.dp_rank = dp_rank
        self.n_samples = n_samples
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.position = 0

    def order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.n_samples)
        return np.random.default_rng(self.seed + epoch).permutation(self.n_samples)

    def __iter__(self) -> Iterator[list[list[int]]]:
        while True:
            order = self.order(self.epoch)
            while self.position < self.steps_per_epoch:
                start = self.position * self.global_batch_size + self.dp_rank * self.local_batch_size
                mine = order[start : start + self.local_batch_size]
                self.position += 1  # before yielding: the state then counts this batch as read
                m = self.micro_batch_size
                yield [mine[k * m : (k + 1) * m].tolist() for k in range(self.grad_accum_steps)]
            self.epoch += 1
            self.position = 0

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


@hookimpl
def plait_declare() -> PluginInfo:
    return PluginInfo(name="sharding", selected_by={"data.sharding": "contiguous"},
                      description="disjoint deterministic per-dp-rank shares of each batch")


@hookimpl
def plait_shard_data(cfg, dataset, topology) -> ShardedBatchSampler:
    return ShardedBatchSampler(
        n_samples=len(dataset),
        global_batch_size=cfg.train.batch_size,
        grad_accum_steps=cfg.train.grad_accum_steps,
        dp_rank=topology.dp_rank,
        dp_size=topology.dims.dp,
        shuffle=OmegaConf.select(cfg, "data.shuffle", default=True),
        seed=cfg.seed,
    )
