"""Starting workers: under torchrun, and under a SLURM-style launcher (environment only)."""

import contextlib
import gc
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from plait.host_memory import preload
from plait.plugins.launch.slurm import first_host, tasks_on_node, torch_env_from_slurm
from plait.testing import (
    TEST_OVERRIDES,
    free_port,
    read_metrics,
    run_losses,
    run_training,
    spawn,
)

pytestmark = pytest.mark.slow
TESTS = Path(__file__).parent

STEPS = ["train.steps=3", "optimizer.decay_steps=3"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Losses of the same run started by plait's own launcher with 2 worker processes."""
    return run_losses(
        tmp_path_factory.mktemp("ref") / "local", [*STEPS, "launcher.nproc_per_node=2"]
    )


def test_torchrun_runs_plait_in_place_with_the_same_losses(reference, tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={free_port()}",
        "-m",
        "plait",
        "train",
        *TEST_OVERRIDES,
        *STEPS,
        f"run.root={tmp_path}",
        "run.name=torchrun",
    ]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    losses = [m["loss"] for m in read_metrics(tmp_path / "torchrun")]
    assert losses == pytest.approx(reference, rel=1e-6)
    # one config written (by rank 0) and no per-worker Hydra output directories
    assert sorted(p.name for p in (tmp_path / "torchrun").iterdir()) == [
        "checkpoints",
        "config.yaml",
        "metrics.jsonl",
    ]
    assert not list(tmp_path.glob("**/.hydra"))


def test_a_launch_leaves_nothing_in_the_temp_directory(tmp_path, monkeypatch):
    """torch elastic gives each launch's workers directories (``torchelastic_*``) in the temp
    directory and leaves them there: one tree per run, thousands on a machine that runs sweeps
    or this suite. plait's launcher removes its own when the launch ends. (``pymp-*`` is
    ``multiprocessing``'s directory of this process, removed when it exits.)"""
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    run_training(tmp_path / "run", [*STEPS, "launcher.nproc_per_node=2"])
    assert [p.name for p in temp.iterdir() if not p.name.startswith("pymp-")] == []


def test_srun_environment_is_translated_for_torch(reference, tmp_path):
    # A stand-in for srun (no SLURM here): start 2 processes with the variables srun sets.
    # They must form one job of 2 ranks: one rank 0 saying so, and the 2-process run's losses.
    # (The losses alone cannot tell: two tasks that each ran a 1-process job of the whole batch
    # in the same directory log the same losses, DDP equalling one process.)
    port = free_port()
    procs = []
    for rank in range(2):
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
        env.update(
            SLURM_PROCID=str(rank),
            SLURM_NTASKS="2",
            SLURM_LOCALID=str(rank),
            SLURM_NODEID="0",
            SLURM_JOB_ID="4242",
            SLURM_STEP_ID="0",
            SLURM_JOB_NODELIST="localhost",
            SLURM_TASKS_PER_NODE="2",
            MASTER_PORT=str(port),
        )
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "plait",
                    "train",
                    *TEST_OVERRIDES,
                    *STEPS,
                    f"run.root={tmp_path}",
                ],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
        )
    outputs = []
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out.decode()[-2000:]
        outputs.append(out.decode())
    started = re.findall(r"plait: training .* on (\d+) process\(es\)", "".join(outputs))
    assert started == ["2"], outputs
    # both ranks agreed on the run directory through the job id, and trained as one job
    losses = [m["loss"] for m in read_metrics(tmp_path / "job-4242")]
    assert losses == pytest.approx(reference, rel=1e-6)


def test_the_worker_server_starts_when_the_launch_names_its_modules():
    """The forkserver's imports (5-7 s of CPU here) start before the elastic agent's set-up, not
    at its first worker: the server runs as soon as ``use_forkserver`` returns. In a fresh
    process (a test session's server would already run); the server is stopped at the end."""
    script = """
import multiprocessing.forkserver, os, signal
from plait.forkserver import use_forkserver
use_forkserver(set(), on_cpu=True, ld_preload=None)
pid = multiprocessing.forkserver._forkserver._forkserver_pid
print("server", pid)
os.kill(pid, signal.SIGKILL)
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert re.fullmatch(r"server \d+\n", done.stdout), done.stdout


def test_the_worker_server_starts_again_under_another_import_time_environment_past_a_live_worker():
    """The libraries the server preloads read some variables once, at import (the Hugging Face
    cache, DeepSpeed's accelerator): a launch under other values of them gets a new server, one
    under the same values keeps it. A worker the old server forked that is still running (a
    rank left hung) holds the server's pipe, yet does not hold up the new server, and keeps
    running. In a fresh process; the last server is stopped at the end."""
    script = """
import multiprocessing.forkserver, os, signal, time
from plait.forkserver import use_forkserver

def server():
    use_forkserver(set(), on_cpu=True, ld_preload=None)
    return multiprocessing.forkserver._forkserver._forkserver_pid

def running(pid):  # and not a zombie: an ended worker its exiting server did not reap
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] not in "ZX"
    except FileNotFoundError:
        return False

first, again = server(), server()
worker = multiprocessing.get_context("forkserver").Process(target=time.sleep, args=(120,))
worker.start()
os.environ["HF_HUB_CACHE"] = "/elsewhere"
other = server()
print(first == again, other != again, running(worker.pid))
os.kill(worker.pid, signal.SIGKILL)  # not worker.kill(): its handle saw its server go
os.kill(other, signal.SIGKILL)
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "True True True\n", done.stdout


def test_the_worker_server_and_the_plait_command_exit_without_the_final_collections(tmp_path):
    """At exit, the worker server and the ``plait`` command skip the interpreter's final garbage
    collections over torch's objects (1-2 s of CPU each here, at the end of every command that
    launched). Shown by tests/exit_probe.py, imported into each process: the reference cycle it
    holds is finalized at the exit of a plain interpreter, not at the server's (started by a
    launch that declares the probe as a library to preload; it exits when the launching process
    does) nor at the command's. In fresh processes, with tests/ on ``PYTHONPATH`` (the server
    of Python 3.11 does not take its launcher's ``sys.path``)."""
    launching = """
import multiprocessing.forkserver
from plait.forkserver import use_forkserver
use_forkserver({"exit_probe"}, on_cpu=True, ld_preload=None)
print(multiprocessing.forkserver._forkserver._forkserver_pid)
"""

    def marks(script: str) -> tuple[str, list[str]]:
        mark = tmp_path / f"mark{len(list(tmp_path.iterdir()))}"
        done = subprocess.run(  # output read to its end: the server, which holds it, has exited
            [sys.executable, "-c", script],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "EXIT_PROBE_MARK": str(mark), "PYTHONPATH": str(TESTS)},
        )
        assert done.returncode == 0, done.stderr
        return done.stdout, mark.read_text().split()

    _, seen = marks("import exit_probe")
    assert seen[::2] == ["imported", "finalized"] and seen[1] == seen[3], seen
    printed, seen = marks(launching)
    assert seen == ["imported", printed.strip()], seen  # the server's pid, not finalized
    printed, seen = marks("import exit_probe; from plait.cli import run; run()")
    assert "usage: plait <command>" in printed
    assert seen[0] == "imported" and "finalized" not in seen, seen


@pytest.mark.skipif(preload("auto") is None, reason="needs tcmalloc or jemalloc installed")
def test_a_cpu_train_commands_worker_server_is_a_fork_of_it_under_the_workers_allocator(
    tmp_path,
):
    """``plait train`` on the CPU runs itself again under the allocator its workers get by default
    (``launcher.allocator=auto``) and forks its worker server from itself, which so inherits the
    torch and plugins the command imported for its plan (plait.command, plait.forkserver); the
    run trains as one whose server is a new interpreter (the in-process reference). With
    ``launcher.allocator=glibc`` the workers take no library: their server is a new interpreter
    as before, and neither it nor they carry the command's."""
    library = preload("auto")

    def command_run(name: str, *overrides: str) -> dict:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "plait",
                "train",
                *TEST_OVERRIDES,
                *STEPS,
                "launcher.nproc_per_node=2",
                "+plugins=[inhouse:record_origin]",
                f"run.root={tmp_path}",
                f"run.name={name}",
                *overrides,
            ],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "PYTHONPATH": str(TESTS)},
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads((tmp_path / name / "origin.json").read_text())

    forked = command_run("forked")
    assert forked["server_command"] == forked["launcher_command"], forked  # a fork: same argv
    assert forked["server_parent"] == forked["launcher"], forked
    assert forked["ld_preload"] == library, forked
    assert forked["allocators"] == [
        a for a in ("libtcmalloc", "libjemalloc") if library.startswith(a)
    ]
    losses = [m["loss"] for m in read_metrics(tmp_path / "forked")]
    reference = run_losses(tmp_path / "reference", [*STEPS, "launcher.nproc_per_node=2"])
    assert losses == pytest.approx(reference, rel=1e-6)

    new = command_run("new", "launcher.allocator=glibc")
    assert "from multiprocessing.forkserver import main" in " ".join(new["server_command"]), new
    assert new["ld_preload"] is None and new["allocators"] == [], new


def pythons() -> dict[str, str]:
    """Each Python this machine has from 3.10 on (plait's ``requires-python``), by version: this
    test's, and every other ``python3.N`` on PATH or among pyenv's versions that runs (a pyenv
    shim with no version selected does not)."""
    candidates = [sys.executable]
    for directory in os.environ.get("PATH", "").split(os.pathsep):
        candidates += sorted(Path(directory).glob("python3.[1-9]*"))
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    candidates += sorted(pyenv.glob("versions/*/bin/python3"))
    found: dict[str, str] = {}
    for python in candidates:
        if not re.fullmatch(r"python(3(\.\d+)?)?", Path(python).name):
            continue  # python3.11-config, python3.11-gdb.py
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            said = subprocess.run(
                [python, "-S", "-c", "import sys; print(*sys.version_info[:2])"],
                capture_output=True,
                text=True,
                timeout=30,
            )
            if said.returncode == 0 and tuple(map(int, said.stdout.split())) >= (3, 10):
                found.setdefault(".".join(said.stdout.split()), str(python))
    return found


def test_the_servers_fork_works_with_every_pythons_multiprocessing():
    """``scripts/check_fork.py`` on every Python found, without site-packages (``-S``: neither
    torch nor the plugins in the server, which a train command's test covers): a server forked
    from the process by ``plait.forkserver``, its workers forked from it with their launch's
    standard output (a passed descriptor) and environment, and a later launch's new server, on
    that interpreter's ``multiprocessing`` internals (the ``-c`` command the fork runs, the
    descriptors it passes), which change between versions while the other tests run on this
    one."""
    failed = {}
    for version, python in pythons().items():
        done = subprocess.run(
            [python, "-S", str(TESTS.parent / "scripts" / "check_fork.py")],
            capture_output=True,
            text=True,
            timeout=120,
        )
        forked = done.stdout.count("forked from this process: True") == 2
        if done.returncode or not forked:
            failed[f"{version} ({python})"] = done.stdout + done.stderr
    assert not failed, failed


def _report_origin(rank: int, world_size: int, out: str) -> None:
    print(f"rank {rank} of {world_size} says hello")
    seen = {"parent": os.getppid(), "probe": os.environ.get("SPAWN_PROBE")}
    (Path(out) / f"{rank}.json").write_text(json.dumps(seen))


def test_spawned_ranks_are_forks_of_the_launchs_worker_server_with_the_callers_env_and_output(
    tmp_path, monkeypatch, capfd
):
    """``plait.testing.spawn`` forks its ranks from the worker server a launch forked its
    workers from (torch and the plugins imported once, not by every rank; no new server, which a
    different allocator would need), yet each rank sees the caller's environment as it is now and
    writes to the caller's standard output."""
    import multiprocessing.forkserver

    run_training(tmp_path / "run", ["train.steps=1", "checkpoint.save_final=false"])
    server = multiprocessing.forkserver._forkserver._forkserver_pid
    monkeypatch.setenv("SPAWN_PROBE", "set after the server started")
    spawn(_report_origin, 2, str(tmp_path))
    assert multiprocessing.forkserver._forkserver._forkserver_pid == server
    seen = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(2)]
    assert seen == [{"parent": server, "probe": "set after the server started"}] * 2
    assert server != os.getpid()
    printed = capfd.readouterr().out
    assert "rank 0 of 2 says hello" in printed and "rank 1 of 2 says hello" in printed


def _private_dirty_kib() -> int:
    with open("/proc/self/smaps_rollup") as rollup:
        return sum(int(line.split()[1]) for line in rollup if line.startswith("Private_Dirty:"))


def _collect_garbage(rank: int, world_size: int, out: str) -> None:
    before = _private_dirty_kib()
    gc.collect()
    copied = _private_dirty_kib() - before
    (Path(out) / f"{rank}.json").write_text(json.dumps({"copied_kib": copied}))


def test_a_forked_rank_collects_its_garbage_without_copying_the_servers_pages(tmp_path):
    """The server's imported objects stay shared with its forks: a full garbage collection in a
    rank visits only what the rank made, so it copies none of the server's pages (without the
    freeze in ``worker_entry`` each rank's collection copied 54 MiB of them here)."""
    spawn(_collect_garbage, 2, str(tmp_path))
    copied = [json.loads((tmp_path / f"{rank}.json").read_text())["copied_kib"] for rank in (0, 1)]
    assert max(copied) < 4096, f"a collection made {copied} KiB of the ranks' pages private"


def test_slurm_variables_map_to_torch_env():
    task = {
        "SLURM_PROCID": "5",
        "SLURM_NTASKS": "8",
        "SLURM_LOCALID": "1",
        "SLURM_STEP_ID": "0",
        "SLURM_NTASKS_PER_NODE": "4",
        "SLURM_NODEID": "1",
        "SLURM_JOB_ID": "1234",
        "SLURM_JOB_NODELIST": "gpu[007-008]",
        "SLURM_LAUNCH_NODE_IPADDR": "10.0.0.99",
    }
    env = torch_env_from_slurm(task, master_port=0)
    # the master is where rank 0 runs (the job's first host), not the node that ran srun;
    # the local world size is this node's tasks, not the job's
    assert env == {
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "1",
        "MASTER_ADDR": "gpu007",
        "MASTER_PORT": str(20000 + 1234),
    }
    assert torch_env_from_slurm({**task, "RANK": "0"}, 0) == {}  # torchrun inside srun
    # the batch step of an sbatch script: SLURM_PROCID=0 and the job's task count, but no step
    batch_step = {k: v for k, v in task.items() if k != "SLURM_STEP_ID"}
    assert torch_env_from_slurm(batch_step, 0) == {}


def test_slurm_host_lists_and_tasks_per_node():
    assert first_host("gpu[003-004,010],cpu1") == "gpu003"
    assert first_host("node7,node8") == "node7"
    assert first_host("a[09-12]-ib") == "a09-ib"
    assert (
        tasks_on_node({"SLURM_TASKS_PER_NODE": "2(x3),1", "SLURM_NTASKS": "7", "SLURM_NODEID": "3"})
        == "1"
    )
    assert (
        tasks_on_node({"SLURM_TASKS_PER_NODE": "2(x3),1", "SLURM_NTASKS": "7", "SLURM_NODEID": "2"})
        == "2"
    )
    # a step of 3 tasks inside that job: its own layout wins
    assert (
        tasks_on_node(
            {
                "SLURM_TASKS_PER_NODE": "2(x3),1",
                "SLURM_NTASKS_PER_NODE": "2",
                "SLURM_STEP_TASKS_PER_NODE": "1(x3)",
                "SLURM_NODEID": "2",
                "SLURM_NTASKS": "3",
            }
        )
        == "1"
    )


def test_rendezvous_events_keep_the_names_torch_gives_them(tmp_path, monkeypatch):
    """torch elastic names each rendezvous event by the method that recorded it, found with
    ``inspect.stack()`` even where no handler records events (0.8 s of the launcher's CPU per
    launch in a test session); plait's launcher finds it from the frames
    (``rendezvous_events.py``). Recorded here, a launch's events carry the same names as under
    torch's own lookup (the same launch again with it; keep-alive events come when a timer is
    due, in either)."""
    import inspect
    import json
    import logging

    from torch.distributed.elastic import events
    from torch.distributed.elastic.events import handlers
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    from plait.plugins.launch import rendezvous_events

    def torchs_lookup(depth=2):  # torch 2.13's dynamic_rendezvous.get_method_name
        if len(inspect.stack()) > depth:
            return inspect.stack()[depth].function
        return "no_method_name"

    names: list[str] = []

    class EventNames(logging.Handler):
        def emit(self, record):
            names.append(json.loads(record.getMessage())["name"])

    recorder = logging.Logger("rendezvous events", logging.INFO)
    recorder.addHandler(EventNames())
    monkeypatch.setitem(handlers._log_handlers, "dynamic_rendezvous", recorder.handlers[0])
    monkeypatch.setitem(events._events_loggers, "dynamic_rendezvous", recorder)
    run_losses(tmp_path / "plait", STEPS)
    assert dynamic_rendezvous.get_method_name is rendezvous_events.method_name
    from_frames, names[:] = list(names), []
    monkeypatch.setattr(rendezvous_events, "name_events_from_frames", lambda: None)
    monkeypatch.setattr(dynamic_rendezvous, "get_method_name", torchs_lookup)
    run_losses(tmp_path / "torch", STEPS)
    kept_alive = {n for n in names + from_frames if n.endswith("._keep_alive")}  # timer's, if due
    assert set(from_frames) - kept_alive == set(names) - kept_alive, (from_frames, names)
    assert len(set(names)) >= 5
    assert "dynamic_rendezvous.py:DynamicRendezvousHandler.next_rendezvous" in names
