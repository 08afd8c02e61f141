"""torchft's lighthouse: the server that forms each step's quorum of replica groups.

plait starts it in the launching process of node 0 (torchft's own ``LighthouseServer``, the Rust
server behind the ``torchft_lighthouse`` command, with the quorum settings as its flags:
``fault.min_replicas``, ``fault.join_timeout_ms``, ``fault.quorum_tick_ms``,
``fault.heartbeat_timeout_ms``), and stops it when the launch ends; the workers of every node
reach it at ``http://<launcher.master_addr>:<port>``. With ``fault.lighthouse=http://host:port``
plait starts none and uses that one, checking before launch that it answers (its HTTP status
page, ``/status``: asking for a quorum or sending a heartbeat would make the checker a member).
"""

from __future__ import annotations

import os
import urllib.error
import urllib.request
from contextlib import contextmanager
from typing import Iterator

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


@contextmanager
def lighthouse(cfg) -> Iterator[str]:
    """The lighthouse's address for this launch: the user's, or one started here on node 0
    (and stopped when the block ends); other nodes reach node 0's."""
    fault, launcher = cfg.fault, cfg.launcher
    if fault.lighthouse:
        yield fault.lighthouse
        return
    host = launcher.master_addr
    if getattr(launcher, "node_rank", 0) != 0:
        yield f"http://{host}:{fault.lighthouse_port}"
        return
    quiet_rust_logs()
    from torchft._torchft import LighthouseServer

    server = LighthouseServer(
        bind=f"[::]:{fault.lighthouse_port}",
        min_replicas=fault.min_replicas,
        join_timeout_ms=fault.join_timeout_ms,
        quorum_tick_ms=fault.quorum_tick_ms,
        heartbeat_timeout_ms=fault.heartbeat_timeout_ms,
    )
    try:
        port = int(server.address().rsplit(":", 1)[1])
        yield f"http://{host}:{port}"
    finally:
        server.shutdown()
