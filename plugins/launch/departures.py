"""Workers whose death the job survives: torch elastic's agent, told which ranks may leave.

torch elastic's agent treats any worker that exits with an error as the failure of the whole
group: ``MultiprocessContext._poll`` calls ``ProcessContext.join``, which terminates every other
worker, and the agent then restarts the group (``launcher.max_restarts``) or fails the job. A
strategy whose workers do not depend on each other (asynchronous parameter-server workers)
declares the ranks whose death is a departure instead (``Roles.expendable``). For those ranks
:class:`DepartingAgent` takes the process out of torch's join and watches it itself: when one
dies it is reported and counted as finished, with no return value, and the others run on. Every
other rank is watched by torch exactly as before, and a run that declares no such rank is
launched with torch's own agent.

torch's ``launch_agent`` (rendezvous, health check, error files) builds its agent by the name
``LocalElasticAgent`` and takes no agent class; :func:`agent_class` substitutes the subclass for
the duration of one launch instead of copying ``launch_agent``.
"""

from __future__ import annotations

import signal
import sys
from contextlib import contextmanager
from typing import Callable, Iterator

from torch.distributed.elastic.agent.server.api import WorkerGroup
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent


def describe_exit(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return signal.Signals(-exitcode).name
        except ValueError:
            return f"signal {-exitcode}"
    return f"exit code {exitcode}"


class DepartingAgent(LocalElasticAgent):
    """``LocalElasticAgent`` for which the death of a rank in ``expendable(world_size)`` is a
    departure, not a failure."""

    def __init__(self, *args, expendable: Callable[[int], frozenset[int]], **kwargs):
        super().__init__(*args, **kwargs)
        self._expendable = expendable
        self._watched: dict[int, int] = {}  # local rank -> global rank, while it runs

    def _start_workers(self, worker_group: WorkerGroup):
        pids = super()._start_workers(worker_group)
        processes = self._pcontext._pc  # torch.multiprocessing's ProcessContext
        self._watched = {}
        for worker in worker_group.workers:
            if worker.global_rank in self._expendable(worker.world_size):
                # torch's join ends every process once one of those it waits on fails
                sentinel = processes.processes[worker.local_rank].sentinel
                del processes.sentinels[sentinel]
                self._watched[worker.local_rank] = worker.global_rank
        return pids

    def _monitor_workers(self, worker_group: WorkerGroup):
        for local_rank, rank in list(self._watched.items()):
            exitcode = self._pcontext._pc.processes[local_rank].exitcode
            if exitcode is None:
                continue
            del self._watched[local_rank]
            if exitcode != 0:
                # done without a value, as far as the context's count of finished workers goes
                self._pcontext._return_values.setdefault(local_rank, None)
                print(
                    f"plait: rank {rank} died ({describe_exit(exitcode)}); the strategy lets "
                    "the job go on without it",
                    file=sys.stderr,
                    flush=True,
                )
        return super()._monitor_workers(worker_group)


@contextmanager
def agent_class(expendable: Callable[[int], frozenset[int]]) -> Iterator[None]:
    """Within this block torch's ``launch_agent`` builds a :class:`DepartingAgent`."""
    from torch.distributed.launcher import api

    def build(*args, **kwargs) -> DepartingAgent:
        return DepartingAgent(*args, expendable=expendable, **kwargs)

    original, api.LocalElasticAgent = api.LocalElasticAgent, build
    try:
        yield
    finally:
        api.LocalElasticAgent = original
