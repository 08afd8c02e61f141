"""Coordination through the job's ``TCPStore`` (the rendezvous store torch elastic already runs):
the servers' inboxes (a queue of what waits for each server: a worker's push, a checkpoint to
write, the end of the run), the servers' answers to checkpoints, and the figures servers and workers publish for the logging rank (W&B: worker throughput, staleness
histogram, server load). Tensors themselves travel point to point (``isend``/``irecv``)."""

from __future__ import annotations

import json

import torch.distributed as dist

PREFIX = "plait/ps/"


def job_store(own_connection: bool = False) -> dist.Store:
    """The default process group's store, under plait's prefix; ``own_connection``: through a
    connection of its own (``Store.clone``), for a thread: a store client serves one call at a
    time, and the main thread may be blocked in ``queue_pop``."""
    store = dist.distributed_c10d._get_default_store()
    return dist.PrefixStore(PREFIX, store.clone() if own_connection else store)


def inbox(server: int) -> str:
    return f"inbox/{server}"


def saved_key(step: int, server: int) -> str:
    """Set by server ``server`` once its part of step ``step``'s checkpoint is written."""
    return f"saved/{step}/{server}"


def publish(store: dist.Store, who: str, figures: dict) -> None:
    store.set(f"figures/{who}", json.dumps(figures))


def read_figures(store: dist.Store, names: list[str]) -> dict[str, dict]:
    """The last figures each of ``names`` published (left out: one that has not yet)."""
    return {
        name: json.loads(store.get(f"figures/{name}"))
        for name in names
        if store.check([f"figures/{name}"])
    }
