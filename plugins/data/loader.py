"""The loader: each step's micro-batches, made ahead of the train loop in the background.

A producer thread walks the sampler from the loader's position and puts whole steps into a
queue of ``data.prefetch`` steps; it builds micro-batches itself (``data.num_workers=0``) or
through a torch ``DataLoader`` with that many worker processes. Batches are pinned on CUDA, and
the engines copy them with ``non_blocking=True``. When the dataset reads remote shards, a
:class:`~plait.plugins.data.cache.ShardPrefetcher` fetches the next ``data.prefetch_shards``
shards into the node-local cache ahead of the producer.

The state is one number, ``consumed_samples``: the global sample position after the last step
the loop took. Batches made ahead and not yet taken are not counted, so a resume rebuilds them
exactly; the order is a pure function of the seed and the position, so nothing else (RNG, epoch,
queue) needs saving, and the state holds for any data-parallel size.
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
from typing import Any, Iterator, Mapping

from plait.plugins.data.cache import ShardPrefetcher


class _Batches:
    """A map-style dataset whose item is a whole micro-batch (``DataLoader(batch_size=None)``)."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __getitem__(self, indices: list[int]):
        return self.dataset.batch(indices)


class StepLoader:
    """Yields, per optimizer step, this rank's ``grad_accum_steps`` micro-batches."""

    def __init__(
        self,
        dataset,
        sampler,
        *,
        num_workers: int = 0,
        prefetch: int = 2,
        prefetch_shards: int = 2,
        pin_memory: bool = False,
    ):
        self.dataset, self.sampler = dataset, sampler
        self.num_workers, self.prefetch = num_workers, prefetch
        self.prefetch_shards, self.pin_memory = prefetch_shards, pin_memory
        self.consumed_samples = 0

    def state_dict(self) -> dict[str, Any]:
        return {"consumed_samples": self.consumed_samples}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.consumed_samples = int(state["consumed_samples"])

    def __iter__(self) -> Iterator[list]:
        start = self.consumed_samples
        prefetcher = None
        if getattr(self.dataset, "fetches_remotely", False):
            prefetcher = ShardPrefetcher(
                (sum(step, []) for step in self.sampler.steps(start)),
                self.dataset.shard_keys,
                self.dataset.fetch,
                self.prefetch_shards,
            )
        ready: queue.Queue = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()
        producer = threading.Thread(
            target=self._produce,
            args=(start, ready, stop, prefetcher),
            daemon=True,
            name="plait-loader",
        )
        producer.start()
        try:
            while True:
                item = ready.get()
                if isinstance(item, BaseException):
                    raise item
                self.consumed_samples += self.sampler.global_batch_size  # this step is read
                yield item
        finally:
            # Joined, not left running: a daemon thread still inside a torch op while the
            # interpreter exits aborts the process ("terminate called without an active
            # exception") when torch's thread pool is torn down under it.
            stop.set()
            while producer.is_alive():
                with contextlib.suppress(queue.Empty):
                    ready.get_nowait()  # unblock a producer waiting to hand over an error
                producer.join(timeout=0.1)
            if prefetcher is not None:
                prefetcher.stop()

    def _micro_batches(self, start: int) -> Iterator:
        indices = itertools.chain.from_iterable(self.sampler.steps(start))
        if self.num_workers == 0:
            for ids in indices:
                batch = self.dataset.batch(ids)
                yield tuple(t.pin_memory() for t in batch) if self.pin_memory else batch
            return
        from torch.utils.data import DataLoader

        # fork, as under torchrun: workers start in milliseconds and inherit the dataset
        # (memory maps, fsspec file systems registered by plugins) instead of unpickling it in
        # a fresh interpreter, which the launcher's spawned workers would otherwise default to.
        yield from DataLoader(
            _Batches(self.dataset),
            sampler=indices,
            batch_size=None,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            prefetch_factor=self.prefetch,
            multiprocessing_context="fork",
        )

    def _produce(
        self,
        start: int,
        ready: queue.Queue,
        stop: threading.Event,
        prefetcher: ShardPrefetcher | None,
    ) -> None:
        accum = self.sampler.grad_accum_steps
        try:
            micro_batches = self._micro_batches(start)
            for step in itertools.count():
                if prefetcher is not None:
                    prefetcher.advance(step)
                batch = list(itertools.islice(micro_batches, accum))
                # Blocks until the loop takes a step or the iterator's end drains the queue: a
                # put with a timeout woke this thread ten times a second for nothing, each wake
                # preempting a rank's main thread on a host with a core per rank.
                ready.put(batch)
                if stop.is_set():
                    return
        except BaseException as e:
            ready.put(e)
