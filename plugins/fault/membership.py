"""How a node leaves an elastic job on purpose: a straggler excluded (``straggler.py``), or a node
cut off from the rendezvous host (``watchdog.py``), which could never rejoin.

torch elastic restarts a failed worker group (``launcher.max_restarts``) and its agent rejoins the
rendezvous, so a node whose workers merely fail comes back. To leave, the node's agent is stopped
the way a scheduler stops ``torchrun``: SIGTERM. torch elastic's ``launch_agent`` then stops the
workers and ends without closing the rendezvous (it closes it only when the job is done), so the
other nodes' agents re-form the group without this node, at fewer nodes, from the last checkpoint.
The other nodes' workers end their attempt with :class:`NodeExcluded` (or the collective error).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import NoReturn

EXIT_LEFT = 3  # a worker's exit code when its agent did not stop it in time
AGENT_GRACE_S = 5.0


class NodeExcluded(RuntimeError):
    """This attempt ends so that the elastic group re-forms without a node that left."""


def under_torch_elastic() -> bool:
    """This worker was started by a torch elastic agent (plait's launcher, ``torchrun``)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def agent_pid() -> int:
    """The agent's process: plait's launcher names itself (``PLAIT_AGENT_PID``; a worker forked
    from a forkserver is not its child); under ``torchrun`` the worker's parent."""
    return int(os.environ.get("PLAIT_AGENT_PID", os.getppid()))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def leave_job(reason: str, first_on_node: bool) -> NoReturn:
    """Print ``reason``; the node's first local worker stops the node's agent, and every worker
    ends once the agent is gone. An agent cut off from the rendezvous host may sit in a store
    call for its ``read_timeout`` (60 s) before it sees the SIGTERM: after ``AGENT_GRACE_S`` it
    is killed. Without an elastic agent the worker only ends itself."""
    agent = agent_pid() if under_torch_elastic() else None
    if first_on_node:
        print(
            f"{reason}\nplait: this node leaves the job: stopping its agent (SIGTERM)",
            file=sys.stderr,
            flush=True,
        )
        if agent is not None:
            os.kill(agent, signal.SIGTERM)
    deadline = time.monotonic() + AGENT_GRACE_S
    while agent is not None and alive(agent) and time.monotonic() < deadline:
        time.sleep(0.1)  # the agent's SIGTERM usually ends this process here
    if first_on_node and agent is not None and alive(agent):
        print("plait: the agent did not stop: killing it (SIGKILL)", file=sys.stderr, flush=True)
        os.kill(agent, signal.SIGKILL)
    os._exit(EXIT_LEFT)
