"""torchft's lighthouse: the server that forms each step's quorum of replica groups.

plait starts it in the launching process of node 0, or of task 0 of a SLURM job (torchft's own
``LighthouseServer``, the Rust server behind the ``torchft_lighthouse`` command, with the quorum
settings as its flags: ``fault.min_replicas``, ``fault.join_timeout_ms``,
``fault.quorum_tick_ms``, ``fault.heartbeat_timeout_ms``), and stops it when the launch ends;
the workers of every node reach it there (:func:`placement`). With
``fault.lighthouse=http://host:port``
plait starts none and uses that one, checking before launch that it answers (its HTTP status
page, ``/status``: asking for a quorum or sending a heartbeat would make the checker a member).
"""

from __future__ import annotations

import os
import urllib.error
import urllib.request
from contextlib import contextmanager
from typing import Iterator

from plait.config import node_range
from plait.topology import first_host, in_srun_task, slurm_job_port

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"  # torchft's own variable: where a Manager finds it
ANSWER_TIMEOUT_S = 3.0


def not_answering(address: str, timeout: float = ANSWER_TIMEOUT_S) -> str | None:
    """Why the lighthouse at ``address`` does not answer, or None when its status page does."""
    try:
        with urllib.request.urlopen(f"{address.rstrip('/')}/status", timeout=timeout) as page:
            if page.status == 200:
                return None
            return f"its status page answered HTTP {page.status}"
    except (urllib.error.URLError, OSError, ValueError) as error:
        reason = getattr(error, "reason", error)
        return f"no answer within {timeout:g} s ({reason})"


def quiet_rust_logs() -> None:
    """torchft's Rust parts (lighthouse, managers) log every quorum tick at INFO; warnings and
    errors only, unless the user set ``RUST_LOG``. Set before torchft is imported, and
    inherited by the workers."""
    os.environ.setdefault("RUST_LOG", "warn")


def placement(cfg, environ) -> tuple[str, int, bool]:
    """Where the lighthouse plait starts listens, as every worker reaches it, and whether this
    process starts it: ``(host, port, here)``; port 0 is a free one (one node only).

    - a local launch on one node: this machine, a free port;
    - on several nodes: node 0 (``launcher.master_addr``), ``fault.lighthouse_port`` or
      ``launcher.master_port + 1``;
    - a task of a SLURM job: task 0's node (the first of the job's node list),
      ``fault.lighthouse_port`` or the job's port + 1 (``plait.topology.slurm_job_port``)."""
    fault, launcher = cfg.fault, cfg.launcher
    if in_srun_task(environ):
        port = fault.lighthouse_port or slurm_job_port(environ, launcher.master_port) + 1
        return first_host(environ["SLURM_JOB_NODELIST"]), port, environ["SLURM_PROCID"] == "0"
    if node_range(launcher.nnodes).max == 1:
        return launcher.master_addr, fault.lighthouse_port, True
    port = fault.lighthouse_port or launcher.master_port + 1
    return launcher.master_addr, port, launcher.node_rank == 0


@contextmanager
def lighthouse(cfg) -> Iterator[str]:
    """The lighthouse's address for this launch: the user's, or one started here (node 0, task
    0 of a SLURM job), stopped when the block ends."""
    if cfg.fault.lighthouse:
        yield cfg.fault.lighthouse
        return
    host, port, here = placement(cfg, os.environ)
    if not here:
        yield f"http://{host}:{port}"
        return
    quiet_rust_logs()
    from torchft._torchft import LighthouseServer

    fault = cfg.fault
    server = LighthouseServer(
        bind=f"[::]:{port}",
        min_replicas=fault.min_replicas,
        join_timeout_ms=fault.join_timeout_ms,
        quorum_tick_ms=fault.quorum_tick_ms,
        heartbeat_timeout_ms=fault.heartbeat_timeout_ms,
    )
    try:
        yield f"http://{host}:{int(server.address().rsplit(':', 1)[1])}"
    finally:
        server.shutdown()
