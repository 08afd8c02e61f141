"""Workers forked from a server that has already imported torch and the plugins: torchrun's
``--start-method forkserver``, plait's default (``launcher.start_method``), and the process
groups of :func:`plait.testing.spawn`. In the core because both use it: the launcher plugin for a
run's workers, the testing helpers for the ranks of a test or a benchmark's plain loop.

A worker started with ``spawn`` is a fresh interpreter. Before its first step it imports torch,
torch's compiler stack (every torch optimizer's constructor imports ``torch._dynamo``), the
plugins and their libraries: 2-4 s of CPU per worker, paid again by every worker of every
launch and of every restart. With ``forkserver`` the launcher starts one server process that
imports them once (this module, listed in ``multiprocessing``'s forkserver preload); every
worker is then a fork of that server, ready at once. A launcher that launches again (a sweep, a
test session, an elastic restart) keeps its server.

What a fork of the server does not carry is mended by :func:`worker_entry`:

- the environment: the server's is the launcher's at the moment the server started, so each
  worker takes the launcher's environment as it is at this launch, and keeps the variables torch
  elastic set for it (``RANK``, ``MASTER_PORT``, ...);
- the intra-op thread count: OpenMP read ``OMP_NUM_THREADS`` when the server imported torch; the
  launcher's value for this launch is set again;
- standard output and error: the server's are the launcher's at the moment the server started
  (a test session's first capture, a terminal since closed). Each launch hands the worker its
  current ones as file descriptors (:class:`PassedFd`, sent as ``multiprocessing`` sends a
  pipe), and the worker puts them in place of its own;
- the sharing of the server's memory: the objects of what the server imported (torch, the
  plugins) lie on pages the worker shares with the server and the other workers until it writes
  to them, and a full garbage collection writes to every object it tracks. A worker freezes
  what it inherited first (``gc.freeze``, the :mod:`gc` module's advice for a process that
  forks without exec), so its collections never visit those objects: 4 workers of a 170M GPT
  under tp2 x pp2 held 214 MiB less between them (54 MiB a worker, of the server's 226 MiB).

The server imports only what this run's workers import: torch, its compiler stack, plait's
worker and plugin modules, and the libraries the run's active plugins declare
(``PluginInfo.preload``: DeepSpeed for ``strategy=zero*``), so a run pays at start-up for no
library it does not use (issue 32). Declared libraries are preloaded on
CPU runs only: importing DeepSpeed probes its accelerator, which on a GPU host initialises
CUDA, and CUDA does not survive a fork. A later launch from the same process whose run needs a
module the server lacks, or another ``LD_PRELOAD`` (``launcher.allocator``), starts a new server
(with the modules of both, so a test session does not flip between two).

A process that is itself a fresh ``plait train`` command (:mod:`plait.command`) starts its
server as a fork of itself (:func:`fork_servers_from_here`): the server then inherits torch and
the plugins the command imported for the plan (about 3 s of CPU a command here) and imports only
the rest. Only where that is safe: a CPU run (CUDA does not survive a fork), whose workers'
``LD_PRELOAD`` is the one the command runs under, from a command that has started no thread since
it was set up (a fork carries no other thread, nor the locks they held). The fork keeps only the
descriptors the new interpreter would have been passed, takes back the default signal handlers,
freezes what it inherited (the server's collections never visit, nor free, the command's objects)
and ends by ``os._exit``.

The server exits without the interpreter's final garbage collections (:func:`freeze_at_exit`):
they would visit every object of torch and its compiler stack, 1-2 s of CPU here at the end of
every command that launched, and the command's caller reads its output to the end only when the
server, which holds the command's standard output, has exited.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.util
import os
import signal
import sys
import threading
import traceback
import warnings
from importlib.metadata import entry_points
from multiprocessing import reduction, resource_tracker
from typing import Any, Callable, Iterable, Sequence

# Set in the environment the server starts with: the server's import of this module sees it.
SERVER_FLAG = "PLAIT_WORKER_SERVER"


def freeze_at_exit() -> None:
    """Skip the interpreter's final garbage collections at this process's exit: at exit
    (``atexit``, after every handler registered later) every object is moved to the permanent
    generation, which no collection visits. With torch and its compiler stack imported those
    collections cost 1.2-1.8 s of CPU here (``python -c "import torch, torch._dynamo, ..."``
    with and without it); what they would free is the exiting process's memory anyway. For
    plait's own processes: the worker server and the ``plait`` command (``plait.cli.run``)."""
    atexit.register(gc.freeze)


if os.environ.pop(SERVER_FLAG, None):  # this process is a server use_forkserver started
    freeze_at_exit()
# The environment the server started with: a forked worker's variables that differ from it were
# set for that worker by torch elastic.
SERVER_ENV = dict(os.environ)
SERVER_PID = os.getpid()  # another pid in a worker: this module was imported by the server
START_METHODS = ("forkserver", "spawn")
# What every worker imports before its first step (a torch optimizer imports torch._dynamo).
PRELOAD = ("torch", "torch._dynamo", "plait.worker")
# Variables the preloaded libraries read once, when imported (DeepSpeed's accelerator, the
# Hugging Face cache and offline mode): the server's imports saw the values of its start.
IMPORT_TIME_ENV = ("DS_", "HF_", "TRANSFORMERS_")
# The server this process started: its modules, LD_PRELOAD and import-time environment (None:
# not started yet); and, where servers may be forks of this process, the LD_PRELOAD it runs
# under and its thread count when that was allowed (fork_servers_from_here).
_server: dict[str, Any] = {"modules": None, "ld_preload": None, "env": None, "fork": None}


def fork_servers_from_here(ld_preload: str | None) -> None:
    """Let the servers this process starts be forks of it (see the module's docstring): for the
    ``plait train`` command, set up under ``ld_preload``, before it has started any thread of its
    own (libraries' idle pools, such as OpenBLAS's, are counted now and allowed)."""
    _server["fork"] = (ld_preload, threads())


def threads() -> int:
    """This process's threads, native ones included (a library's pool has no Python thread)."""
    return len(os.listdir("/proc/self/task"))


def import_time_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(IMPORT_TIME_ENV)}


def use_forkserver(declared: Iterable[str], on_cpu: bool, ld_preload: str | None) -> None:
    """Name the modules the server imports: ``PRELOAD``, the plugins of the ``plait``
    entry-point group (each worker's plugin manager loads them) and, on CPU runs, the libraries
    the active plugins ``declared``, and start the server now: its imports (5-7 s of CPU here)
    then overlap the elastic agent's own set-up and rendezvous (0.6 s here) instead of following
    them. A server already running without them, under another ``ld_preload`` or another
    import-time environment (``IMPORT_TIME_ENV``: a later launch's ``HF_HUB_CACHE`` must reach
    its workers' ``huggingface_hub``), is stopped first. The server starts with ``ld_preload``
    as its ``LD_PRELOAD`` (the allocator its forks inherit), whatever this process's is."""
    plugins = sorted({entry.module for entry in entry_points(group="plait")})
    modules = {__name__, *PRELOAD, *(declared if on_cpu else ()), *plugins}
    env = import_time_env()
    server = multiprocessing.forkserver._forkserver
    running = getattr(server, "_forkserver_pid", None) is not None
    same_start = ld_preload == _server["ld_preload"] and env == _server["env"]
    if running and (not modules <= _server["modules"] or not same_start):
        if ld_preload == _server["ld_preload"]:
            modules |= _server["modules"]
        _stop(server)
    elif running:
        return
    _server.update(modules=modules, ld_preload=ld_preload, env=env)
    multiprocessing.get_context("forkserver").set_forkserver_preload(sorted(modules))
    own = os.environ.pop("LD_PRELOAD", None)
    if ld_preload is not None:
        os.environ["LD_PRELOAD"] = ld_preload
    os.environ[SERVER_FLAG] = "1"
    try:
        if may_fork(on_cpu, ld_preload):
            _ensure_running_by_fork()
        else:
            multiprocessing.forkserver.ensure_running()  # the server takes this environment
    finally:
        os.environ.pop(SERVER_FLAG, None)
        os.environ.pop("LD_PRELOAD", None)
        if own is not None:
            os.environ["LD_PRELOAD"] = own


def may_fork(on_cpu: bool, ld_preload: str | None) -> bool:
    """Whether this launch's server may be a fork of this process (the module's docstring)."""
    if _server["fork"] is None or not on_cpu:
        return False
    loaded, thread_count = _server["fork"]
    return loaded == ld_preload and threading.active_count() == 1 and threads() <= thread_count


def _ensure_running_by_fork() -> None:
    """``multiprocessing.forkserver.ensure_running``, with the server a fork of this process:
    the command it would start a new interpreter with (``main(...)`` of
    ``multiprocessing.forkserver``, and the descriptors it passes) runs in the fork instead."""
    resource_tracker.ensure_running()  # a new interpreter, as before: not forked below
    spawn_new = multiprocessing.util.spawnv_passfds
    multiprocessing.util.spawnv_passfds = _fork_passfds
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        multiprocessing.util.spawnv_passfds = spawn_new


def _fork_passfds(path: Any, args: Sequence[Any], passfds: Sequence[int]) -> int:
    """``multiprocessing.util.spawnv_passfds(path, args, passfds)``'s process, as a fork: runs
    the ``-c`` command of ``args`` with only ``passfds`` and standard input, output and error
    open; returns its pid."""
    command = str(args[list(args).index("-c") + 1])
    sys.stdout.flush()
    sys.stderr.flush()
    with warnings.catch_warnings():  # Python 3.12's about threads: may_fork counted them
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        _become_server(passfds)
        exec(command, {"__name__": "__mp_forkserver__"})
        code = 0
    except SystemExit as end:  # the server's end: every launcher has let go of its pipe
        code = end.code if isinstance(end.code, int) else int(end.code is not None)
    except BaseException:  # noqa: BLE001 - shown, then the fork ends as the interpreter would
        traceback.print_exc()
    finally:
        os._exit(code)


def _become_server(passfds: Sequence[int]) -> None:
    """In the fork: what a new interpreter would have been (see the module's docstring)."""
    global SERVER_ENV, SERVER_PID
    gc.freeze()
    low = 0
    for fd in sorted({0, 1, 2, *passfds}):
        if low < fd:  # closerange(n, n) would close every descriptor from n (close_range(n, ~0))
            os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, os.sysconf("SC_OPEN_MAX"))
    for number in signal.valid_signals():
        with contextlib.suppress(OSError, ValueError):
            handler = signal.getsignal(number)
            if callable(handler) and handler is not signal.default_int_handler:
                signal.signal(number, signal.SIG_DFL)
    os.environ.pop(SERVER_FLAG, None)
    SERVER_ENV, SERVER_PID = dict(os.environ), os.getpid()


def _stop(server: Any) -> None:
    """Stop the server this process started without waiting on any other process.

    ``multiprocessing``'s own stop (``_stop``) closes the pipe the server watches and waits for
    the server to exit; but every process forked from the server holds that pipe too, so one
    worker of an earlier launch that has not ended (a rank left hung by a test's timeout) keeps
    the server, and with it this launch, waiting for ever (on CI once: a test's whole 10-minute
    timeout, then every later launch of that process failed on the half-stopped server). The
    server is killed first (what it forked runs on as separate processes), then that stop reaps
    it and clears its address."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(server._forkserver_pid, signal.SIGKILL)
    server._stop()


class PassedFd:
    """A file descriptor of the launcher that a pickled worker argument carries to the worker:
    ``multiprocessing``'s ``DupFd`` sends it to the forkserver with the worker's other
    descriptors, and it unpickles as the worker's duplicate of it."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self):
        return _detach, (reduction.DupFd(self.fd),)


def _detach(dup) -> int:
    return dup.detach()


def launcher_stdio() -> tuple[PassedFd, PassedFd]:
    sys.stdout.flush()
    sys.stderr.flush()
    return PassedFd(1), PassedFd(2)


def worker_entry(
    entrypoint: Callable[..., Any], launcher_env: dict[str, str], stdio: tuple[int, int], *args: Any
) -> Any:
    """Run ``entrypoint(*args)`` in a forked worker as if it had been spawned by the launcher:
    its environment, thread count and standard output and error (``stdio``, the launcher's
    as :func:`launcher_stdio` passed them), and with the server's objects frozen (see the
    module's docstring)."""
    gc.freeze()
    for fd, target in zip(stdio, (1, 2)):
        os.dup2(fd, target)
        os.close(fd)
    if SERVER_PID == os.getpid():  # a server started without plait's preload: add, keep all
        os.environ.update({k: v for k, v in launcher_env.items() if k not in os.environ})
    else:
        set_by_torch = {k: v for k, v in os.environ.items() if SERVER_ENV.get(k) != v}
        os.environ.clear()
        os.environ.update(launcher_env)
        os.environ.update(set_by_torch)
    if "OMP_NUM_THREADS" in os.environ:
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    return entrypoint(*args)
