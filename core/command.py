"""The ``plait`` command's process (the console script and ``python -m plait``), set up before
torch is imported.

``plait train`` on the CPU forks its workers from a worker server (:mod:`plait.forkserver`)
that imports torch, its compiler stack and the plugins. Started as a new interpreter, the server
imports again what the command has already imported for the plan: torch and the plugins, about 3
s of CPU of the 9 a tiny run's command takes here. A server that is a fork of the command
inherits them; but the workers' allocator (``launcher.allocator``, tcmalloc by default on the CPU)
is a library the dynamic loader preloads when a program starts, which a fork cannot add. So
``plait train`` first runs itself again under the library the CPU workers get by default
(``os.execve``: same process, same arguments, with the library in ``LD_PRELOAD``), and gives the
caller's ``LD_PRELOAD`` back to its environment, so that nothing it starts inherits the library
unasked. A run whose workers get that library then gets a forked server; another allocator, a
GPU run, or a command that has started a thread since, gets a new interpreter as before.
"""

from __future__ import annotations

import os
import sys

# Set across the ``execve``: the caller's LD_PRELOAD ("=" + its value), or "-" where it had none.
CALLER_PRELOAD = "PLAIT_CALLER_LD_PRELOAD"
# Set in a process of an external launcher's job (torchrun, SLURM), which may train in place:
# its allocator is that launcher's to choose, and it is left as started.
EXTERNAL_LAUNCHER_ENV = ("LOCAL_RANK", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")


def run() -> None:
    """``plait <command>``: for ``train`` outside an external launcher's job, under the CPU
    workers' default allocator, with worker servers forked from this process where their workers
    take it; then :func:`plait.cli.run`."""
    training = sys.argv[1:2] == ["train"] and not any(
        v in os.environ for v in EXTERNAL_LAUNCHER_ENV
    )
    started_with = under_workers_allocator() if training else None
    from plait import cli, forkserver

    if training:  # after cli's imports: the threads they start (OpenBLAS's pool) are counted
        forkserver.fork_servers_from_here(started_with)
    cli.run()


def under_workers_allocator() -> str | None:
    """Make this process run under the allocator CPU workers get by default
    (``launcher.allocator=auto``); return the ``LD_PRELOAD`` it runs under. Runs the command again
    when that library is installed and not yet preloaded, and does not return then."""
    from plait.host_memory import preload, with_preload

    if CALLER_PRELOAD in os.environ:  # run again: give the caller's LD_PRELOAD back
        given = os.environ.pop(CALLER_PRELOAD)
        loaded = os.environ.pop("LD_PRELOAD", None)
        if given != "-":
            os.environ["LD_PRELOAD"] = given[1:]
        return loaded
    caller = os.environ.get("LD_PRELOAD")
    wanted = with_preload(dict(os.environ), preload("auto")).get("LD_PRELOAD")
    if wanted is None or wanted == caller or not sys.executable:
        return caller
    before = "-" if caller is None else "=" + caller
    env = {**os.environ, "LD_PRELOAD": wanted, CALLER_PRELOAD: before}
    os.execve(sys.executable, sys.orig_argv, env)
