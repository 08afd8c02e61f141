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
tests run on one interpreter. So do the descriptors a launch passes its workers (standard output
and error, sent as ``multiprocessing`` sends a pipe). This script loads ``core/forkserver.py`` by
its path, lets a server be forked from itself, starts two workers from it through
``worker_entry`` as the launcher does, and then a second server for another module (the old one
killed), and checks each from ``/proc``:

- the server is a fork of this process (its parent, and the same command line);
- the workers are forks of the server, exit 0, and have the standard output and the environment
  of their launch, both set after the server started;
- a later launch that needs another module gets a new server, also forked, whose workers run.
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import multiprocessing.forkserver
import os
import shutil
import sys
import tempfile
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


def report(queue) -> None:
    """In a worker: its parent, what its standard output is, and its launch's variable."""
    queue.put((os.getppid(), os.readlink("/proc/self/fd/1"), os.environ.get(LAUNCH_VARIABLE)))


LAUNCH_VARIABLE = "PLAIT_CHECK_FORK_LAUNCH"


def run_workers(forkserver, count: int, launch: str, output: str) -> list[tuple]:
    """Start ``count`` workers from the server as plait's launcher does (``worker_entry``), with
    this process's environment and ``launch`` in it, and standard output ``output``: both set
    after the server started, so the workers have them only if handed over. Each worker's report
    and exit code."""
    context = multiprocessing.get_context("forkserver")
    queue = context.Queue()
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # no torch to set
    env[LAUNCH_VARIABLE] = launch
    sys.stdout.flush()
    own = os.dup(1)
    with open(output, "w") as redirected:
        os.dup2(redirected.fileno(), 1)
    try:
        args = (report, env, forkserver.launcher_stdio(), queue)
        workers = [context.Process(target=forkserver.worker_entry, args=args) for _ in range(count)]
        for worker in workers:
            worker.start()
    finally:
        os.dup2(own, 1)
        os.close(own)
    reports = [queue.get(timeout=60) for _ in workers]
    for worker in workers:
        worker.join(60)
    return [(*seen, worker.exitcode) for seen, worker in zip(reports, workers)]


def server_pid() -> int:
    return multiprocessing.forkserver._forkserver._forkserver_pid


def main() -> int:
    forkserver = load_forkserver()
    forkserver.fork_servers_from_here(None)
    command_line = Path("/proc/self/cmdline").read_bytes()
    output = tempfile.mkdtemp(prefix="check_fork")
    servers, held, lines = [], True, []
    for launch, declared in enumerate(((), ("json",)), 1):  # the second needs another module
        forkserver.use_forkserver(declared=declared, on_cpu=True, ld_preload=None)
        server = server_pid()
        stdout = os.path.join(output, f"launch{launch}.out")
        workers = run_workers(forkserver, 2, str(launch), stdout)
        forked = (
            parent_of(server) == os.getpid()
            and Path(f"/proc/{server}/cmdline").read_bytes() == command_line
        )
        from_server = all(parent == server for parent, *_ in workers)
        handed = all(out == stdout and var == str(launch) for _, out, var, _ in workers)
        codes = [code for *_, code in workers]
        held &= forked and from_server and handed and codes == [0] * len(workers)
        servers.append(server)
        lines.append(
            f"Python {sys.version.split()[0]}: server {launch} forked from this process: "
            f"{forked}; its workers forked from it: {from_server}, with their launch's standard "
            f"output and environment: {handed}, exit codes {codes}"
        )
    shutil.rmtree(output)
    lines.append(f"the second launch started a new server: {servers[0] != servers[1]}")
    print("\n".join(lines))
    return 0 if held and servers[0] != servers[1] else 1


if __name__ == "__main__":
    sys.exit(main())
