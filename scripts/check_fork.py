"""Check, on any Python, that ``plait.forkserver``'s fork of the worker server works with that
interpreter's ``multiprocessing``: standard library only, no torch, no plait install.

    python3.13 -S scripts/check_fork.py         # prints three lines, exits 0 when all hold

(``-S``: no site-packages. Without it, an interpreter with torch and plait installed has its server
import them, as a ``plait train`` command's does: the same check, 8 s slower.)

A ``plait train`` command starts its worker server as a fork of itself (``core/command.py``,
``core/forkserver.py``): the fork runs the ``-c`` command that ``multiprocessing.forkserver``'s
``ensure_running`` would start a new interpreter with, read from the arguments it hands
``multiprocessing.util.spawnv_passfds``. Those are ``multiprocessing``'s internals, which change
between Python versions (3.14 added an authentication key on a descriptor of its own), while the
tests run on one interpreter. This script loads ``core/forkserver.py`` by its path, lets a
server be forked from itself, starts two workers from it and then a second server for another
module (the old one killed), and checks each from ``/proc``:

- the server is a fork of this process (its parent, and the same command line);
- the workers are forks of the server and exit 0;
- a later launch that needs another module gets a new server, also forked, whose workers run.
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import multiprocessing.forkserver
import os
import sys
from pathlib import Path

FORKSERVER = Path(__file__).resolve().parent.parent / "core" / "forkserver.py"


def load_forkserver():
    """``core/forkserver.py`` as a module of its own: it imports only the standard library."""
    spec = importlib.util.spec_from_file_location("plait_forkserver", FORKSERVER)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # the server and its workers find it by this name
    spec.loader.exec_module(module)
    return module


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def report_parent(queue) -> None:
    queue.put((os.getpid(), os.getppid()))


def run_workers(count: int) -> tuple[list[int], list[int]]:
    """Start ``count`` workers from the server; their parents and exit codes."""
    context = multiprocessing.get_context("forkserver")
    queue = context.Queue()
    workers = [context.Process(target=report_parent, args=(queue,)) for _ in range(count)]
    for worker in workers:
        worker.start()
    parents = [queue.get(timeout=60)[1] for _ in workers]
    for worker in workers:
        worker.join(60)
    return parents, [worker.exitcode for worker in workers]


def server_pid() -> int:
    return multiprocessing.forkserver._forkserver._forkserver_pid


def main() -> int:
    forkserver = load_forkserver()
    forkserver.fork_servers_from_here(None)
    command_line = Path("/proc/self/cmdline").read_bytes()
    results = []
    for declared in ((), ("json",)):  # the second launch needs a module the first server lacks
        forkserver.use_forkserver(declared=declared, on_cpu=True, ld_preload=None)
        server = server_pid()
        parents, codes = run_workers(2)
        forked = (
            parent_of(server) == os.getpid()
            and Path(f"/proc/{server}/cmdline").read_bytes() == command_line
        )
        results.append((server, forked, parents == [server] * len(parents), codes))
    (first, *_), (second, *_) = results
    lines = [
        f"Python {sys.version.split()[0]}: server {i} forked from this process: {forked}; "
        f"its workers forked from it: {from_server}, exit codes {codes}"
        for i, (_, forked, from_server, codes) in enumerate(results, 1)
    ]
    lines.append(f"the second launch started a new server: {second != first}")
    print("\n".join(lines))
    held = all(f and w and set(c) == {0} for _, f, w, c in results) and second != first
    return 0 if held else 1


if __name__ == "__main__":
    sys.exit(main())
