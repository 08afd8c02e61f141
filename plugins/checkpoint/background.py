"""``checkpoint.async_save=true``: the checkpoint's layout-free state is copied to CPU memory while
training waits, then written by a background thread (``torch.distributed.checkpoint.async_save``);
the checkpoint is published (``complete.json``, the rename, ``latest``) only after every rank's
write has finished. A crash before that leaves the previous checkpoint as ``latest``, and the
next save removes the unfinished ``.partial`` directory.

At most one write is in flight: a save first waits for the previous one. The background writes
talk over a process group of their own (gloo), so their collectives never interleave with the
training step's on the trainer group (torchtitan does the same).
"""

from __future__ import annotations

import sys
from concurrent.futures import Future
from typing import Callable


def cpu_stager():
    """DCP's stager as a CPU run needs it: a plain blocking copy into fresh CPU memory (no
    pinned or shared memory to cache, no non-blocking copy)."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    return DefaultStager(
        StagingOptions(
            use_pinned_memory=False,
            use_shared_memory=False,
            use_async_staging=False,
            use_non_blocking_copy=False,
        )
    )


class BackgroundWrites:
    def __init__(self) -> None:
        self.published: Future | None = None  # the write in flight, done once published

    def start(self, write: Callable, publish: Callable[[], None] | None) -> None:
        """``write(stager)`` copies the state with ``stager`` and returns the future of the
        write it started in the background; when that has finished, ``publish`` runs (on the
        rank that publishes; None elsewhere), in the writer's thread."""
        stager = cpu_stager()
        published: Future = Future()

        def finished(done: Future) -> None:
            stager.close()
            try:
                done.result()
                if publish is not None:
                    publish()
            except BaseException as e:  # noqa: BLE001 -- handed to the waiter
                print(
                    f"plait: background checkpoint write failed ({e!r}); the previous "
                    "checkpoint stays the latest",
                    file=sys.stderr,
                    flush=True,
                )
                published.set_exception(e)
            else:
                published.set_result(None)

        self.published = published
        write(stager).add_done_callback(finished)

    def wait(self) -> None:
        """Until the write in flight (if any) is written and published; its error is raised."""
        published, self.published = self.published, None
        if published is not None:
            published.result()
