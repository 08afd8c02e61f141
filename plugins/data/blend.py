"""``data.sources=[{path: a, weight: 0.7}, {path: b, weight: 0.3}]``: several corpora mixed by
weight, deterministically, as Megatron's ``BlendedDataset`` does.

Position ``p`` of the blend goes to the source that is furthest below its share
(Megatron's ``build_blending_indices``: ``argmax_j weight_j * max(p, 1) - drawn_j``), computed
once over a period of ``PERIOD`` positions and repeated, so every window of the stream holds each
source in proportion to its weight (to within a few samples per period). The ``k``-th draw from
a source is that source's sample at position ``k`` of its own epochs, each in that source's
shuffled order (seeded by ``seed + j`` for source ``j``); a small source repeats, a large one is
only partly seen, as in Megatron.

Sample ids of the blend are ``offset_j + i`` for sample ``i`` of source ``j``.
"""

from __future__ import annotations

import numpy as np
import torch

from plait.plugins.data.cache import shard_keys_in_order

PERIOD = 1 << 16


def blending_indices(weights: list[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """Megatron's greedy blend: for each position, the source and how many draws that source
    had before it."""
    drawn = [0] * len(weights)
    source = np.empty(size, dtype=np.int64)
    draw = np.empty(size, dtype=np.int64)
    for p in range(size):
        at = max(p, 1)
        j = max(range(len(weights)), key=lambda i: (weights[i] * at - drawn[i], -i))
        source[p], draw[p] = j, drawn[j]
        drawn[j] += 1
    return source, draw


class BlendedDataset:
    def __init__(self, datasets: list, weights: list[float]):
        total = float(sum(weights))
        self.datasets = datasets
        self.weights = [w / total for w in weights]
        self.sizes = np.array([len(d) for d in datasets], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)])
        self.seq_len = datasets[0].seq_len
        self.source, self.draw = blending_indices(self.weights, PERIOD)
        self.per_period = np.bincount(self.source, minlength=len(datasets))
        self.fetches_remotely = any(d.fetches_remotely for d in datasets)

    def __len__(self) -> int:
        return int(self.offsets[-1])  # one epoch of the blend: as many draws as samples

    def epoch_order(self, seed: int, epoch: int) -> np.ndarray:
        positions = np.arange(epoch * len(self), (epoch + 1) * len(self), dtype=np.int64)
        period, at = np.divmod(positions, PERIOD)
        source = self.source[at]
        draws = period * self.per_period[source] + self.draw[at]
        ids = np.empty(len(positions), dtype=np.int64)
        for j, dataset in enumerate(self.datasets):
            mine = source == j
            source_epoch, i = np.divmod(draws[mine], self.sizes[j])
            picked = np.empty(len(i), dtype=np.int64)
            for e in np.unique(source_epoch):
                here = source_epoch == e
                picked[here] = dataset.epoch_order(seed + j, int(e))[i[here]]
            ids[mine] = self.offsets[j] + picked
        return ids

    def locate(self, indices: list[int]) -> list[tuple[int, int]]:
        sources = np.searchsorted(self.offsets, indices, side="right") - 1
        return [(int(j), int(i - self.offsets[j])) for j, i in zip(sources, indices)]

    def batch(self, indices: list[int]):
        located = self.locate(indices)
        rows = np.stack([self.datasets[j].window(i) for j, i in located])
        rows = torch.from_numpy(rows.astype(np.int64))
        if not self.datasets[0].pack:
            return rows[:, :-1], rows[:, 1:]
        positions = np.stack([self.datasets[j].positions(i) for j, i in located])
        return rows[:, :-1], rows[:, 1:], torch.from_numpy(positions)

    def shard_keys(self, indices: list[int]) -> list[tuple[int, int]]:
        return shard_keys_in_order(
            (j, k) for j, i in self.locate(indices) for k in self.datasets[j].shard_keys([i])
        )

    def fetch(self, key: tuple[int, int]) -> None:
        self.datasets[key[0]].fetch(key[1])
