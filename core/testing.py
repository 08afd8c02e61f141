"""Helpers for testing plait and in-house plugins: compose a config, run a real training job.

from plait.testing import run_losses

def test_my_plugin_keeps_losses(tmp_path):
    base = run_losses(tmp_path / "a", ["train.steps=5"])
    mine = run_losses(tmp_path / "b", ["train.steps=5", "+plugins=[my_team.fancy]"])
    assert mine == pytest.approx(base, rel=1e-6)
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Iterator

from omegaconf import DictConfig

from plait import api, hookimpl
from plait.plan import make_plan

# Settings that keep a test run small and quiet: the tiny GPT, no W&B, a few steps, on the CPU
# (on a GPU host `device=auto` would give rank 1 `cuda:1`); a CUDA test passes `device=cuda`.
TEST_OVERRIDES = (
    "model=gpt_tiny",
    "tracker=none",
    "train.steps=4",
    "train.batch_size=8",
    "train.seq_len=32",
    "optimizer.warmup_steps=2",
    "device=cpu",
    "train.log_every=1",  # every step in metrics.jsonl: what a test compares step by step
)


def compose(overrides: Iterable[str] = (), plugins: Iterable[Any] = ()) -> DictConfig:
    """The config ``plait train <overrides>`` would run with (checked: raises ``PlanError``)."""
    return make_plan(overrides, plugins).check().cfg


def run_training(
    run_dir: str | Path, overrides: Iterable[str] = (), plugins: Iterable[Any] = ()
) -> Path:
    """Run ``plait train`` for real (worker processes included) into ``run_dir``; return it."""
    run_dir = Path(run_dir)
    return api.train(
        [*TEST_OVERRIDES, f"run.root={run_dir.parent}", f"run.name={run_dir.name}", *overrides],
        plugins,
    ).run_dir


def run_losses(
    run_dir: str | Path, overrides: Iterable[str] = (), plugins: Iterable[Any] = ()
) -> list[float]:
    """Per-step losses of a real run (read back from ``metrics.jsonl``)."""
    run_training(run_dir, overrides, plugins)
    return [m["loss"] for m in read_metrics(run_dir)]


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The logged steps of a run from ``run_dir/metrics.jsonl`` (written by the metrics_file
    plugin); a resumed run's steps follow the earlier ones."""
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(fn, world_size: int, *args: Any, nproc_per_node: int | None = None) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes joined in a gloo process
    group (``torch.multiprocessing``); an exception in any rank fails the caller.

    The ranks are forked from the worker server a launch forks its workers from
    (:mod:`plait.forkserver`: torch, its compiler stack and the plugins already imported),
    instead of each importing them again as a fresh interpreter (2-4 s of CPU per rank here),
    with the caller's environment and standard output and error. They get the allocator plait's
    CPU workers get by default (``launcher.allocator=auto``, in ``LD_PRELOAD``), so that a test
    session's spawns and launches share one server: a server runs under one ``LD_PRELOAD``, and
    each change would start another. ``fn`` must be importable (module level); the rank imports
    its module. Ranks return results by writing files. ``nproc_per_node`` sets the launcher's
    node variables (``GROUP_RANK``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``) as for that many
    processes per node, node by node, so a topology sees several "nodes" on one machine; the
    default is one node.
    """
    import torch.multiprocessing as mp

    from plait.forkserver import launcher_stdio, use_forkserver
    from plait.host_memory import preload, with_preload

    env = with_preload(dict(os.environ), preload("auto"))
    use_forkserver((), on_cpu=True, ld_preload=env.get("LD_PRELOAD"))
    mp.start_processes(
        _forked,
        args=(
            env,
            launcher_stdio(),
            (fn, world_size, nproc_per_node or world_size, free_port(), args),
        ),
        nprocs=world_size,
        join=True,
        start_method="forkserver",
    )


def _forked(rank: int, caller_env: dict[str, str], stdio: tuple[int, int], spawned: tuple) -> None:
    from plait.forkserver import worker_entry

    worker_entry(_spawned, caller_env, stdio, rank, *spawned)


def _spawned(rank: int, fn, world_size: int, nproc_per_node: int, port: int, args: tuple) -> None:
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank % nproc_per_node),
        LOCAL_WORLD_SIZE=str(nproc_per_node),
        GROUP_RANK=str(rank // nproc_per_node),
    )
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()
    exit_without_teardown()


def exit_without_teardown(code: int = 0) -> None:
    """End a finished distributed child process as a forked worker ends (``os._exit``, after
    flushing Python's output), not through the interpreter's teardown.

    A ``spawn``-started child returns through ``sys.exit``, and at teardown objects that held
    gloo work (a DeepSpeed engine, layers holding their group) are freed after the process group
    is gone; now and then this aborted the child ("terminate called without an active
    exception", SIGABRT: ``scripts/bench_zero.py``'s raw ZeRO-3 loop, ``bench_tp.py``; see
    pytorch/pytorch#179291). torch elastic's and ``multiprocessing``'s forked workers end with
    ``os._exit`` and never met it. Only for a child whose work is done and whose results are
    written."""
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def read_wandb_run(run_dir: str | Path) -> dict[str, Any]:
    """Read back an offline W&B run written under ``run_dir/wandb``: its id, name, group,
    job type, notes, config and history (of the newest run there).

    The ``.wandb`` file is a LevelDB-style log (a 7-byte ``:W&B`` header, then 32 KiB blocks of
    records, each a 7-byte header — crc32c, little-endian length, chunk type — and a chunk of a
    protobuf ``Record``); wandb ships the protobuf classes but no reader.
    """
    from wandb.proto import wandb_internal_pb2 as pb

    [path] = sorted(Path(run_dir).glob("wandb/offline-run-*/run-*.wandb"))[-1:]
    data, block, pos, pending = path.read_bytes(), 32768, 7, b""
    run: dict[str, Any] = {
        "id": None,
        "name": None,
        "group": None,
        "job_type": None,
        "notes": None,
        "config": {},
        "history": [],
        "path": path,
    }
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # too little room for a header: the block is padded
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 0:
            continue
        pending += chunk
        if kind in (1, 4):  # FULL or LAST chunk: a whole record
            record = pb.Record()  # type: ignore[attr-defined]  # generated protobuf
            record.ParseFromString(pending)
            pending = b""
            _collect(record, run)
    return run


def _collect(record, run: dict[str, Any]) -> None:
    kind = record.WhichOneof("record_type")
    if kind == "run":
        run["id"] = record.run.run_id
        run.update(
            name=record.run.display_name,
            group=record.run.run_group,
            job_type=record.run.job_type,
            notes=record.run.notes,
        )
        for item in record.run.config.update:
            run["config"][item.key] = json.loads(item.value_json)
    elif kind == "config":
        for item in record.config.update:
            run["config"][item.key] = json.loads(item.value_json)
    elif kind == "history":
        run["history"].append(
            {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
        )


class StepClock:
    """A plugin for benchmarks: rank 0's wall clock at the end of every step, one line each."""

    def __init__(self, path: str | Path):
        self.path = str(path)

    @hookimpl
    def plait_on_step_end(self, step):
        with open(self.path, "a") as f:
            f.write(f"{time.perf_counter()}\n")


class StepLog:
    """A plugin for benchmarks of failures: every step rank 0 of replica group 0 (rank 0 of a
    job that runs as one) attempts, the time it ended (``time.monotonic``, comparable across
    processes) and whether it was taken, one JSON line each; a restarted process appends."""

    def __init__(self, path: str | Path):
        self.path = str(path)

    @hookimpl(wrapper=True)
    def plait_build_engine(self, topology):
        engine = yield
        if topology.rank == 0 and topology.replica_group_id == 0:
            step = engine.train_step

            def logged(micro_batches, lr):
                out = step(micro_batches, lr=lr)
                with open(self.path, "a") as f:
                    f.write(json.dumps({"t": time.monotonic(), "taken": not out.skipped}) + "\n")
                return out

            engine.train_step = logged
        return engine


class KillRank:
    """A plugin for benchmarks of failures: SIGKILLs rank ``rank`` of replica group ``group``
    (group 0: a job that runs as one) as its ``step``-th step starts, once per run directory
    (a marker file ``killed`` there)."""

    def __init__(self, step: int, rank: int, group: int = 0):
        self.step, self.rank, self.group = step, rank, group

    @hookimpl(wrapper=True)
    def plait_build_engine(self, cfg, topology):
        engine = yield
        marker = Path(cfg.run.dir) / "killed"
        if (topology.rank, topology.replica_group_id) == (self.rank, self.group):
            step, calls = engine.train_step, iter(range(1, 1 << 30))

            def killing(micro_batches, lr):
                if next(calls) == self.step and not marker.exists():
                    marker.write_text(f"rank {self.rank} of group {self.group}")
                    os.kill(os.getpid(), signal.SIGKILL)
                return step(micro_batches, lr=lr)

            engine.train_step = killing
        return engine


class GroupsStartTogether:
    """A plugin for runs whose replica groups are torch jobs of their own (``fault=torchft``), on
    one machine: each group's first attempt waits before its first quorum until all ``groups``
    are there (files in ``run.dir``), so the run starts with every group in its first quorum
    instead of the first ones stepping while a later one recovers from them."""

    def __init__(self, groups: int, timeout_s: float = 300.0):
        self.groups, self.timeout_s = groups, timeout_s

    @hookimpl(wrapper=True)
    def plait_sync_replicas(self, cfg, state, topology):
        if state is None and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) == 0:
            here = Path(cfg.run.dir) / "groups_started"
            here.mkdir(parents=True, exist_ok=True)
            (here / str(topology.replica_group_id)).touch()
            deadline = time.monotonic() + self.timeout_s
            while len(list(here.iterdir())) < self.groups and time.monotonic() < deadline:
                time.sleep(0.05)
        return (yield)


class MemoryProbe:
    """A plugin for tests and benchmarks: each worker's memory around the building of its model.

    ``rss_before_model``: resident memory just before the model is built (interpreter, torch, the
    plugins' imports, process groups and data: what no layout saves), logged by the logging rank
    as ``memory/rss_before_model_bytes``. ``build_peak``: the kernel's peak resident memory
    (``VmHWM``, reset when the build starts) from the build until the model is materialized and
    cut, above ``rss_before_model``: what building this rank's part cost at its worst. Every rank
    writes both to ``run.dir/memory/rank<r>.json``. Peak memory over the run is plait's own
    ``peak_memory_bytes/max``.
    """

    rss_before_model = 0
    materialized = False

    @hookimpl(wrapper=True)
    def plait_build_model(self):
        # The last build before the materialization is the one that counts (plan checks build
        # on the meta device before; a model built whole is built again). Later meta builds
        # (a strategy sizing its buffers from the model) would move the baseline above the
        # model's own memory and forget the peak so far.
        if not self.materialized:
            self.rss_before_model = resident_bytes()
            reset_peak_resident_bytes()
        return (yield)

    # The first hook after the materialization; a wrapper decides nothing, and the outermost
    # one (tryfirst) reads the peak before other plugins' wrappers allocate.
    @hookimpl(wrapper=True, tryfirst=True)
    def plait_build_loss(self, cfg, topology):
        self.materialized = True
        build_peak = peak_resident_bytes() - self.rss_before_model
        path = Path(cfg.run.dir) / "memory" / f"rank{topology.rank}.json"
        path.parent.mkdir(exist_ok=True)
        path.write_text(
            json.dumps({"rss_before_model": self.rss_before_model, "build_peak": build_peak})
        )
        return (yield)

    @hookimpl(tryfirst=True)  # before the trackers write the step
    def plait_log_metrics(self, metrics):
        metrics["memory/rss_before_model_bytes"] = float(self.rss_before_model)


memory_probe = MemoryProbe()  # for `+plugins=[plait.testing:memory_probe]` on a command line


class ImportFirst:
    """A plugin for tests and benchmarks: imports ``modules`` in every worker before the model is
    built (outermost wrapper), so that :class:`MemoryProbe`'s pre-model baseline holds the
    libraries a strategy imports while it builds and steps (DeepSpeed, DTensor/FSDP, torch's
    ``_dynamo`` that torch's optimizers import: 20-70 MiB each) and its figures are the model's
    and the engine's alone. Name only modules the run imports anyway, or its memory grows."""

    def __init__(self, *modules: str):
        self.modules = modules

    @hookimpl(wrapper=True, tryfirst=True)
    def plait_build_model(self):
        import importlib

        for name in self.modules:
            importlib.import_module(name)
        return (yield)


class LoadClock:
    """A plugin for benchmarks: how long and how much memory building the model took, from the
    first ``plait_build_model`` (after importing ``modules``, so the figures are the model's)
    until the engine is built (every parameter loaded, partitioned and wrapped). Every rank
    writes ``{"seconds", "peak"}`` (the rise of its peak resident memory) to
    ``run.dir/load/rank<r>.json``."""

    def __init__(self, modules: Iterable[str] = ()):
        self.modules, self.started, self.base, self.pid = tuple(modules), None, 0, None

    @hookimpl(wrapper=True, tryfirst=True)
    def plait_build_model(self):
        import importlib

        for name in self.modules:
            importlib.import_module(name)
        if self.pid != os.getpid():  # the first build in this worker (the plan built it before)
            self.base, self.pid = resident_bytes(), os.getpid()
            reset_peak_resident_bytes()
            self.started = time.perf_counter()
        return (yield)

    @hookimpl(wrapper=True)
    def plait_build_engine(self, cfg, topology):
        engine = yield
        path = Path(cfg.run.dir) / "load" / f"rank{topology.rank}.json"
        path.parent.mkdir(exist_ok=True)
        path.write_text(
            json.dumps(
                {
                    "seconds": time.perf_counter() - self.started,
                    "peak": peak_resident_bytes() - self.base,
                }
            )
        )
        return engine


def reset_peak_resident_bytes() -> None:
    """Start this process's peak resident memory (``VmHWM``) afresh (Linux ``clear_refs``)."""
    Path("/proc/self/clear_refs").write_text("5")


def peak_resident_bytes() -> int:
    """This process's peak resident memory since start or the last reset (``VmHWM``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no VmHWM")


def resident_bytes() -> int:
    """This process's resident set size now (Linux ``/proc/self/statm``)."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE")


class SaveClock:
    """A plugin for benchmarks: how long each step's ``plait_save_checkpoint`` call (every
    wrapper around it included) held the logging rank, one JSON line per step in
    ``run.dir/save_seconds.jsonl``: ``{"step", "seconds"}``."""

    @hookimpl(wrapper=True, tryfirst=True)
    def plait_save_checkpoint(self, cfg, state, topology):
        started = time.perf_counter()
        written = yield
        if topology.is_logging_rank:
            with open(Path(cfg.run.dir) / "save_seconds.jsonl", "a") as f:
                f.write(
                    json.dumps({"step": state.step, "seconds": time.perf_counter() - started})
                    + "\n"
                )
        return written


class SlowRank:
    """A plugin for tests and benchmarks: a straggler. Global rank ``rank`` sleeps ``seconds``
    before each forward pass of its model (registered on every rank; only that one sleeps).

        run_training(run_dir, [...], plugins=[SlowRank(rank=2, seconds=0.2)])
    """

    def __init__(self, rank: int, seconds: float):
        self.rank, self.seconds = rank, seconds

    @hookimpl
    def plait_apply_tensor_parallel(self, model, topology):
        if topology.rank == self.rank:
            model.register_forward_pre_hook(self._sleep)

    def _sleep(self, module, args) -> None:
        time.sleep(self.seconds)


class LinkCounter:
    """A plugin for runs on ``scripts/netns_cluster.py``: what this node's link
    (``PLAIT_LINK_DEV``, set by the script) has carried, read from its veth counters by rank 0 at
    the end of every step, one JSON line per step in ``run.dir/link.jsonl``. With two nodes,
    node 0's link sees everything that crosses between nodes (its tx plus its rx).

        python scripts/netns_cluster.py -- '+plugins=[plait.testing:link_counter]' ...
    """

    @hookimpl
    def plait_on_run_start(self, cfg):
        self.path = Path(cfg.run.dir) / "link.jsonl"
        self.statistics = Path("/sys/class/net") / os.environ["PLAIT_LINK_DEV"] / "statistics"

    @hookimpl
    def plait_on_step_end(self, step):
        counts = {
            name: int((self.statistics / name).read_text())
            for name in ("tx_bytes", "rx_bytes", "tx_packets", "rx_packets")
        }
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **counts}) + "\n")


link_counter = LinkCounter()


def link_bytes_per_step(run_dir: str | Path, skip: int) -> float:
    """Bytes across the link (tx + rx of node 0) per step, from step ``skip`` to the last."""
    lines = [json.loads(line) for line in (Path(run_dir) / "link.jsonl").read_text().splitlines()]
    first, last = lines[skip - 1], lines[-1]
    total = (last["tx_bytes"] + last["rx_bytes"]) - (first["tx_bytes"] + first["rx_bytes"])
    return total / (last["step"] - first["step"])


def steps_per_s(stamps: list[float], warmup: int) -> float:
    """Steps per second between the end of step ``warmup`` and the last step."""
    timed = stamps[warmup:]
    return (len(timed) - 1) / (timed[-1] - timed[0])


class MemoryCgroup:
    """A memory cgroup made by :func:`memory_cgroup`: cgroup v2, or v1's memory hierarchy."""

    def __init__(self, path: Path, v2: bool):
        self.path, self.v2 = path, v2

    def command(self, command: list[str]) -> list[str]:
        """``command`` started inside this cgroup (and every process it starts)."""
        join = f'echo $$ > {self.path / "cgroup.procs"} && exec "$@"'
        return ["sh", "-c", join, "sh", *command]

    def peak_bytes(self) -> int:
        """The kernel's peak of the group's memory."""
        return int(
            (self.path / ("memory.peak" if self.v2 else "memory.max_usage_in_bytes")).read_text()
        )

    def oom_kills(self) -> int:
        """How many of the group's processes the kernel killed for memory."""
        events = (self.path / ("memory.events" if self.v2 else "memory.oom_control")).read_text()
        return sum(
            int(line.split()[1]) for line in events.splitlines() if line.startswith("oom_kill ")
        )


@contextmanager
def memory_cgroup(mib: float) -> Iterator[MemoryCgroup]:
    """A fresh memory cgroup capped at ``mib`` MiB with swap off (root, Linux); on exit every
    process left in it is killed and the group removed."""
    v2 = Path("/sys/fs/cgroup/cgroup.controllers").exists()
    path = (
        Path("/sys/fs/cgroup" if v2 else "/sys/fs/cgroup/memory")
        / f"plait-{os.getpid()}-{time.monotonic_ns()}"
    )
    path.mkdir()
    limit = str(int(mib * (1 << 20)))
    try:
        if v2:
            (path / "memory.max").write_text(limit)
            (path / "memory.swap.max").write_text("0")
        else:
            (path / "memory.limit_in_bytes").write_text(limit)
            swap = path / "memory.memsw.limit_in_bytes"
            if swap.exists():
                swap.write_text(limit)
        yield MemoryCgroup(path, v2)
    finally:
        for pid in (path / "cgroup.procs").read_text().split():
            os.kill(int(pid), signal.SIGKILL)
        while (path / "cgroup.procs").read_text().strip():
            time.sleep(0.1)
        path.rmdir()
