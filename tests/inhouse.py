"""In-house plugins used by the tests, loaded the way users load theirs (dotted paths, objects)."""

from __future__ import annotations

import collections
import contextlib
import hashlib
import itertools
import json
import os
import signal
import sys
import traceback
import warnings
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from plait import hookimpl
from plait.topology import Roles
from plait.types import PluginInfo


class CrashAtStep:
    """Raises in the train loop after step ``step`` has been checkpointed or not (a real crash)."""

    def __init__(self, step: int):
        self.step = step

    @hookimpl
    def plait_declare(self):
        return PluginInfo(name="crash_at_step")

    @hookimpl
    def plait_on_step_end(self, step):
        if step == self.step:
            raise RuntimeError(f"injected crash at step {step}")


class FancyEngine:
    """A second plugin deciding plait_build_engine: must conflict with ddp."""

    @hookimpl
    def plait_declare(self):
        return PluginInfo(name="fancy_engine")

    @hookimpl
    def plait_build_engine(self, cfg):
        raise AssertionError("never built: the plan is refused first")


class Fp32Only:
    @hookimpl
    def plait_declare(self):
        return PluginInfo(
            name="fp32_only", precisions=frozenset({"fp32"}), parallel_axes=frozenset({"dp"})
        )


class RecordPlacement:
    """Writes, on every rank, where the strategy's engine put the model and the process group's
    backend and size: ``placement_rank<r>.json`` in ``directory``."""

    def __init__(self, directory):
        self.directory = str(directory)

    @hookimpl
    def plait_declare(self):
        return PluginInfo(name="record_placement")

    @hookimpl(wrapper=True)
    def plait_build_engine(self, topology):
        engine = yield
        record = {
            "rank": topology.rank,
            "local_rank": topology.local_rank,
            "device": str(next(engine.model.parameters()).device),
            "backend": dist.get_backend(),
            "world_size": dist.get_world_size(),
        }
        Path(self.directory, f"placement_rank{topology.rank}.json").write_text(json.dumps(record))
        return engine


class RecordDeviceWaits:
    """Where the host waits for the GPU inside the engine's step, on steps ``first`` to ``last``
    of the run (torch's sync debug mode): for every synchronizing call, the names of the Python
    functions on the stack, innermost last; one JSON line per step in ``<directory>/waits.jsonl``
    (rank 0)."""

    def __init__(self, directory, first: int, last: int):
        self.directory, self.first, self.last = str(directory), first, last

    @hookimpl
    def plait_declare(self):
        return PluginInfo(name="record_device_waits")

    @hookimpl(wrapper=True)
    def plait_build_engine(self, topology):
        engine = yield
        if topology.rank == 0:
            engine.train_step = self._watched(engine.train_step)
        return engine

    def _watched(self, step):
        taken = itertools.count(1)

        def train_step(micro_batches, lr):
            if not self.first <= next(taken) <= self.last:
                return step(micro_batches, lr=lr)
            waits = []

            def show(message, *args, **kwargs):
                if "called a synchronizing" in str(message):  # not the mode's own notice
                    stack = traceback.extract_stack()[:-1]  # this function's frame left out
                    while stack and stack[-1].filename == warnings.__file__:
                        stack.pop()  # the warnings module's own frames
                    waits.append([frame.name for frame in stack])

            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = show
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    out = step(micro_batches, lr=lr)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            with open(Path(self.directory, "waits.jsonl"), "a") as f:
                f.write(json.dumps(waits) + "\n")
            return out

        return train_step


def read_placements(directory) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(Path(directory).glob("placement_rank*.json"))]


crash_at_step_3 = CrashAtStep(3)


class RecordBatches:
    """Records what the model is fed: every step's input rows on every rank, as SHA-1 digests,
    one JSON line per step in ``<directory>/rank<r>-<pid>.jsonl`` (``directory`` None:
    ``run.dir/rows``); with ``kill_at``, rank 0 SIGKILLs its own process after that step (a real
    worker death, before the step's checkpoint)."""

    def __init__(self, directory, kill_at=None):
        self.directory, self.kill_at = directory, kill_at

    @hookimpl
    def plait_declare(self):
        return PluginInfo(name="record_batches")

    @hookimpl(wrapper=True, tryfirst=True)  # outermost: what the loop feeds, also to a pipeline
    def plait_build_engine(self, cfg, topology):
        engine = yield
        directory = str(self.directory or Path(cfg.run.dir) / "rows")
        return RecordingEngine(engine, directory, topology.rank, self.kill_at)


record_rows = RecordBatches(None)  # for +plugins=[inhouse:record_rows]


class RecordingEngine:
    def __init__(self, engine, directory, rank, kill_at):
        self.engine, self.rank, self.kill_at, self.steps = engine, rank, kill_at, 0
        self.path = Path(directory) / f"rank{rank}-{os.getpid()}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def train_step(self, micro_batches, lr):
        rows = [
            [hashlib.sha1(row.numpy().tobytes()).hexdigest()[:16] for row in x]
            for x, _ in micro_batches
        ]
        with open(self.path, "a") as f:
            f.write(json.dumps(rows) + "\n")
        out = self.engine.train_step(micro_batches, lr)
        self.steps += 1
        if self.rank == 0 and self.steps == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    def __getattr__(self, name):
        return getattr(self.engine, name)


def recorded_micro_batches(directory, rank):
    """Each recorded step's micro-batches (their rows) of ``rank``, per file (one per process,
    in the order they were written)."""
    files = sorted(Path(directory).glob(f"rank{rank}-*.jsonl"), key=lambda p: p.stat().st_mtime)
    return [[json.loads(line) for line in f.read_text().splitlines()] for f in files]


def recorded_steps(directory, rank):
    """Each recorded step's rows of ``rank``, files in the order they were written."""
    return [[sum(step, []) for step in steps] for steps in recorded_micro_batches(directory, rank)]


def attempt() -> int:
    import os

    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))


class KillAt:
    """SIGKILLs global rank ``rank`` right after step ``step`` (and its checkpoint, if due), once
    per run directory: a real worker death, which the launcher's restart must survive."""

    def __init__(self, step: int, rank: int = 1):
        self.step, self.rank = step, rank

    @hookimpl
    def plait_declare(self):
        return PluginInfo(name="kill_at_step")

    @hookimpl(wrapper=True)
    def plait_save_checkpoint(self, cfg, state, topology):
        import os
        import signal

        result = yield
        marker = Path(cfg.run.dir, "killed")
        if state.step == self.step and topology.rank == self.rank and not marker.exists():
            marker.write_text(f"rank {self.rank} after step {self.step}")
            os.kill(os.getpid(), signal.SIGKILL)
        return result


kill_rank1_at_5 = KillAt(5)
kill_rank2_at_3 = KillAt(3, rank=2)


class AwaitLostWorker:
    """Holds global rank ``rank`` after step ``step`` until parameter server 0 publishes that
    only ``alive`` workers are left (at most 120 s): the loss is then noticed while this worker
    still has steps to push and log, however slow the machine (without the hold, a survivor
    that finished first logged its last step before the server had read the failed goodbye)."""

    def __init__(self, step: int, rank: int, alive: int):
        self.step, self.rank, self.alive = step, rank, alive

    @hookimpl
    def plait_declare(self):
        return PluginInfo(name="await_lost_worker")

    @hookimpl(wrapper=True)
    def plait_save_checkpoint(self, cfg, state, topology):
        import time

        from plait.plugins.parameter_server.store import job_store, read_figures

        result = yield
        if state.step == self.step and topology.rank == self.rank:
            store, deadline = job_store(), time.monotonic() + 120
            while time.monotonic() < deadline:
                server = read_figures(store, ["server0"]).get("server0", {})
                if server.get("workers_alive") == self.alive:
                    break
                time.sleep(0.05)
        return result


await_rank2_lost_at_4 = AwaitLostWorker(4, rank=1, alive=1)


class KillServerAt:
    """SIGKILLs parameter server ``rank`` once per run directory, when it has written its shard of
    step ``step``'s checkpoint and before it says so: that checkpoint stays incomplete."""

    def __init__(self, step: int, rank: int):
        self.step, self.rank = step, rank

    @hookimpl
    def plait_declare(self):
        return PluginInfo(name="kill_server_at")

    @hookimpl(wrapper=True)
    def plait_run_role(self, cfg, topology):
        marker = Path(cfg.run.dir, "server_killed")
        if topology.rank == self.rank and not marker.exists():
            from plait.plugins.parameter_server.server import Server

            save, step = Server.save, self.step

            def save_then_die(server, directory, saved_step):
                save(server, directory, saved_step)
                if saved_step == step:
                    marker.write_text(f"server rank {topology.rank} at step {step}")
                    os.kill(os.getpid(), signal.SIGKILL)

            Server.save = save_then_die
        return (yield)


class KillNodeAt:
    """SIGKILLs every process of node ``node`` (its agent and workers: the worker's process
    group, which the test started as a session of its own) right after step ``step``'s
    checkpoint, once per run directory: a whole node lost."""

    def __init__(self, step: int, node: int = 1):
        self.step, self.node = step, node

    @hookimpl
    def plait_declare(self):
        return PluginInfo(name="kill_node_at_step")

    @hookimpl(wrapper=True)
    def plait_save_checkpoint(self, cfg, state, topology):
        result = yield
        marker = Path(cfg.run.dir, "killed")
        if state.step == self.step and topology.node_rank == self.node and not marker.exists():
            marker.write_text(f"node {self.node} after step {self.step}")
            os.killpg(os.getpgid(0), signal.SIGKILL)
        return result


kill_node1_at_3 = KillNodeAt(3)


class HoldAfter:
    """Every worker for which ``holds(topology)`` is true stops once step ``step``'s checkpoint
    is published, and its local rank 0 writes ``run.dir/<flag>``: the test's cue to act on that
    node (SIGKILL it, or start another beside it). Other nodes' workers go on into the next step
    and wait for it there."""

    def __init__(self, name: str, step: int, flag: str, holds):
        self.name, self.step, self.flag, self.holds = name, step, flag, holds

    @hookimpl
    def plait_declare(self):
        return PluginInfo(name=self.name)

    @hookimpl(wrapper=True)
    def plait_save_checkpoint(self, cfg, state, topology):
        import time

        result = yield
        if state.step == self.step and self.holds(topology):
            if topology.local_rank == 0:
                Path(cfg.run.dir, self.flag).write_text(f"after step {self.step}")
            time.sleep(600)
        return result


# Node 1 (the launcher's GROUP_RANK) in the first attempt: a node lost mid-run at a known step.
hold_node1_after_step_4 = HoldAfter(
    "hold_node1", 4, "node1_held", lambda topology: attempt() == 0 and topology.node_rank == 1
)
# A node training alone (the world is its own processes): the cue to start a second node, whose
# arrival makes torch elastic's agent restart the group to take it in, which ends the wait.
hold_alone_after_step_2 = HoldAfter(
    "hold_alone",
    2,
    "node0_alone_held",
    lambda topology: os.environ.get("WORLD_SIZE") == os.environ.get("LOCAL_WORLD_SIZE"),
)


class NanLoss:
    """Makes the loss (``what="loss"``) or the gradient of this rank's first parameter
    (``what="grad"``) NaN (or ``factor`` times what it is: a loss spike) on global rank ``rank``
    for the engine's optimizer-step calls ``first .. first+count-1`` of the first attempt.
    Every rank records, for each poisoned call, whether the engine skipped it and whether
    parameters and optimizer state stayed the same bytes: ``directory/skip_rank<r>_call<n>.json``.
    Works under every engine: the loss through ``engine.loss_fn`` (DDP, ZeRO), the gradient
    through a tensor hook (also inside a pipeline schedule, which holds its own loss function)."""

    def __init__(
        self,
        directory,
        first: int,
        count: int,
        rank: int = 1,
        what: str = "loss",
        factor: float = float("nan"),
    ):
        self.directory, self.first, self.count, self.rank = str(directory), first, count, rank
        self.what, self.factor = what, factor

    @hookimpl
    def plait_declare(self):
        return PluginInfo(name="nan_loss")

    @hookimpl(wrapper=True, tryfirst=True)  # outermost: around the pipeline engine too
    def plait_build_engine(self, topology):
        engine = yield
        if attempt() > 0:
            return engine
        calls, inner_step, inner_loss = itertools.count(1), engine.train_step, engine.loss_fn
        nan, factor = [False], self.factor
        if self.what == "grad":
            first_param = next(engine.model.parameters())
            first_param.register_hook(lambda g: g * factor if nan[0] else g)

        def train_step(micro_batches, lr):
            n = next(calls)
            poisoned = self.first <= n < self.first + self.count
            nan[0] = poisoned and topology.rank == self.rank
            if self.what == "loss":
                engine.loss_fn = (lambda y, t: inner_loss(y, t) * factor) if nan[0] else inner_loss
            before = snapshot(engine) if poisoned else None
            out = inner_step(micro_batches, lr)
            if poisoned:
                after = snapshot(engine)
                same = before.keys() == after.keys() and all(
                    torch_equal(before[k], after[k]) for k in before
                )
                Path(self.directory, f"skip_rank{topology.rank}_call{n}.json").write_text(
                    json.dumps({"skipped": out.skipped, "unchanged": same})
                )
            return out

        engine.train_step = train_step
        return engine


def snapshot(engine) -> dict:
    """Parameters (this rank's partition under ZeRO-3, ``ds_tensor``), buffers, the optimizer's
    own parameters (DeepSpeed's fp32 master partitions under ZeRO) and optimizer state, as flat
    ``name -> tensor`` copies."""
    import torch

    model = engine.model
    flat = {
        f"model.{k}": getattr(v, "ds_tensor", v).detach().clone()
        for k, v in [*model.named_parameters(), *model.named_buffers()]
    }
    optimizer = engine.optimizer
    for g, group in enumerate(optimizer.param_groups):
        for i, param in enumerate(group["params"]):
            flat[f"optim.{g}.{i}"] = param.detach().clone()
            for k, v in optimizer.state.get(param, {}).items():
                flat[f"optim.{g}.{i}.{k}"] = (
                    v.clone() if isinstance(v, torch.Tensor) else torch.tensor(v)
                )
    return flat


def torch_equal(a, b) -> bool:
    import torch

    return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))


class Rank0:
    """The topology of a one-process run, as far as saving reads it."""

    rank = 0
    is_logging_rank = True
    roles = Roles({"trainer": (0,)})
    trainer_group = None
    local_rank = local_trainer_rank = node_rank = quorum_rank = 0
    dims = SimpleNamespace(dp=1, cp=1, tp=1, pp=1, ep=1)


@contextlib.contextmanager
def stderr_into(path: Path):
    """Send this process's file descriptor 2 (and so the stderr of every worker it starts, which
    inherits it) into ``path`` for the block: what a user's terminal would show."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "w") as file:
        os.dup2(file.fileno(), 2)
    try:
        yield path
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


class NoCapabilities:
    """The hook relay of a run as far as the checkpoint plugin reads it: no active plugin
    declares a capability, so an engine is saved through its own files only."""

    @staticmethod
    def plait_declare() -> list:
        return []


# ---------------------------------------------------------------------------------------------
# probes: test-only plugins that report from inside the workers of a real run, into run.dir
# ---------------------------------------------------------------------------------------------


class CommCounter:
    """Counts calls of the collectives the tensor-parallel regions use, by kind (it replaces
    ``torch.distributed``'s functions, which the regions look up at each call)."""

    KINDS = ("all_reduce", "all_gather", "reduce_scatter")

    def __init__(self):
        self.counts = collections.Counter()
        self.originals = {kind: getattr(dist, kind) for kind in self.KINDS}

    def __enter__(self):
        for kind, fn in self.originals.items():
            setattr(dist, kind, self._counting(kind, fn))
        return self

    def _counting(self, kind, fn):
        def wrapper(*args, **kwargs):
            self.counts[kind] += 1
            return fn(*args, **kwargs)

        return wrapper

    def __exit__(self, *exc):
        for kind, fn in self.originals.items():
            setattr(dist, kind, fn)

    def take(self) -> dict[str, int]:
        taken = {k: v for k, v in self.counts.items() if v}
        self.counts.clear()
        return taken


class WireRecorder:
    """Records what this process hands to ``torch.distributed``: every point-to-point send
    (``isend``, ``send``) as ``(peer's global rank, bytes)`` in ``sends``, and every all-reduce
    as ``(group, bytes)`` in ``all_reduces``, ``group`` being the name of a plait algorithm's
    group (``"ring"``, ``"hierarchical"``: an :class:`AlgorithmGroup` run with sends) or
    ``"backend"`` (gloo's or NCCL's own all-reduce).

    It replaces those functions of ``torch.distributed``, which plait's ring and torch's comm
    hooks (compression, PowerSGD) look up at each call, so it sees what a real reducer sends,
    also from inside DDP's backward. Thread-safe: the explicit algorithms run on the reducer's
    thread, the pipelined hierarchical all-reduce on three.
    """

    def __init__(self):
        import threading

        self.sends: list[tuple[int, int]] = []
        self.all_reduces: list[tuple[str, int]] = []
        self.lock = threading.Lock()
        self.originals = {name: getattr(dist, name) for name in ("isend", "send", "all_reduce")}

    def __enter__(self):
        from plait.plugins.comm.algorithm import AlgorithmGroup

        def sending(fn):
            def send(tensor, dst=None, group=None, tag=0, group_dst=None):
                peer = (
                    dst
                    if group_dst is None
                    else (group_dst if group is None else dist.get_global_rank(group, group_dst))
                )
                with self.lock:
                    self.sends.append((peer, tensor.numel() * tensor.element_size()))
                return fn(tensor, dst=dst, group=group, tag=tag, group_dst=group_dst)

            return send

        def all_reduce(tensor, *args, **kwargs):
            group = kwargs.get("group", args[1] if len(args) > 1 else None)
            name = group.name if isinstance(group, AlgorithmGroup) else "backend"
            with self.lock:
                self.all_reduces.append((name, tensor.numel() * tensor.element_size()))
            return self.originals["all_reduce"](tensor, *args, **kwargs)

        dist.isend, dist.send = sending(self.originals["isend"]), sending(self.originals["send"])
        dist.all_reduce = all_reduce
        return self

    def __exit__(self, *exc):
        for name, fn in self.originals.items():
            setattr(dist, name, fn)

    def take(self) -> tuple[list[tuple[int, int]], list[tuple[str, int]]]:
        """What was recorded since the last ``take``: ``(sends, all_reduces)``."""
        with self.lock:
            taken = self.sends, self.all_reduces
            self.sends, self.all_reduces = [], []
        return taken


class CountCollectives:
    """Rank 0's collectives per step, by kind: one JSON line per step in
    ``run.dir/collectives.jsonl`` (what the step's forward, backward, gradient norm and metrics
    called)."""

    @hookimpl
    def plait_declare(self):
        return PluginInfo(name="count_collectives")

    @hookimpl
    def plait_on_run_start(self, cfg):
        self.path = Path(cfg.run.dir) / "collectives.jsonl"
        self.counter = CommCounter().__enter__()

    @hookimpl
    def plait_on_step_end(self, step):
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **self.counter.take()}) + "\n")

    @hookimpl(wrapper=True)
    def plait_save_checkpoint(self):
        result = yield
        if hasattr(self, "counter"):  # rank 0: a checkpoint's collectives (the layout-free
            self.counter.take()  # copy joins tp shards) are not the next step's
        return result

    @hookimpl
    def plait_on_run_end(self):
        self.counter.__exit__(None, None, None)


class TracePipelineActions:
    """The pipeline actions each rank ran in the first step, in order, named as torch's schedules
    name them: ``<stage>F<micro-batch>`` forward, ``B`` full backward, ``I`` backward for the
    input only, ``W`` the deferred backward for the weights. Written to
    ``run.dir/actions_rank<r>.json``; recorded around ``PipelineStage``'s methods, which every
    torch schedule calls."""

    @hookimpl
    def plait_declare(self):
        return PluginInfo(name="trace_pipeline_actions")

    @hookimpl(wrapper=True, tryfirst=True)  # outermost: sees the pipeline plugin's engine
    def plait_build_engine(self, cfg, topology):
        engine = yield
        actions: list[str] = []
        for stage in engine.stages:
            _trace_stage(stage, actions)
        path = Path(cfg.run.dir) / f"actions_rank{topology.rank}.json"
        after_first_step(engine, lambda: path.write_text(json.dumps(actions)))
        return engine


def after_first_step(engine, callback) -> None:
    """Call ``callback()`` once, when the engine's first ``train_step`` has returned."""
    train_step = engine.train_step

    def first_step(*args, **kwargs):
        out = train_step(*args, **kwargs)
        engine.train_step = train_step
        callback()
        return out

    engine.train_step = first_step


def _trace_stage(stage, actions: list[str]) -> None:
    forward, backward, weight = (
        stage.forward_one_chunk,
        stage.backward_one_chunk,
        stage.backward_weight_one_chunk,
    )
    s = stage.stage_index

    def forward_one_chunk(mb, *args, **kwargs):
        actions.append(f"{s}F{mb}")
        return forward(mb, *args, **kwargs)

    def backward_one_chunk(mb, *args, full_backward=True, **kwargs):
        actions.append(f"{s}{'B' if full_backward else 'I'}{mb}")
        return backward(mb, *args, full_backward=full_backward, **kwargs)

    def backward_weight_one_chunk(mb, *args, **kwargs):
        actions.append(f"{s}W{mb}")
        return weight(mb, *args, **kwargs)

    stage.forward_one_chunk = forward_one_chunk
    stage.backward_one_chunk = backward_one_chunk
    stage.backward_weight_one_chunk = backward_weight_one_chunk


class DescribeZeroOptimizer:
    """What DeepSpeed's optimizer is after the first step, from rank 0: the class that steps,
    ZeRO's offload flags, and the devices holding the optimizer states (none before they
    exist) (``run.dir/zero_optimizer.json``)."""

    @hookimpl
    def plait_declare(self):
        return PluginInfo(name="describe_zero_optimizer")

    @hookimpl(wrapper=True, tryfirst=True)
    def plait_build_engine(self, cfg, topology):
        engine = yield
        if topology.rank == 0:
            path = Path(cfg.run.dir) / "zero_optimizer.json"
            after_first_step(
                engine,
                lambda: path.write_text(json.dumps(_describe_zero_optimizer(engine.ds.optimizer))),
            )
        return engine


def _describe_zero_optimizer(zero_optimizer) -> dict:
    inner = zero_optimizer.optimizer
    states = [
        t
        for state in inner.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor) and t.dim() > 0
    ]
    return {
        "stepping": type(inner).__name__,
        "offload_optimizer": bool(getattr(zero_optimizer, "offload_optimizer", False)),
        "offload_param": bool(getattr(zero_optimizer, "offload_param", False)),
        "state_devices": sorted({t.device.type for t in states}),
    }


class DescribeZeroGroups:
    """How DeepSpeed's ZeRO optimizer steps its partition, from rank 0 right after the engine is
    built (``run.dir/zero_groups.json``): the elements of each flat partition it steps at once
    (ZeRO-1/2: one per parameter group; ZeRO-3: one per sub-group), the ``sub_group_size`` it
    was configured with, and for each partition whether the fp32 master the optimizer steps is
    the parameter partition itself (shares its storage) rather than a copy."""

    @hookimpl
    def plait_declare(self):
        return PluginInfo(name="describe_zero_groups")

    @hookimpl(wrapper=True, tryfirst=True)
    def plait_build_engine(self, cfg, topology):
        engine = yield
        if topology.rank == 0:
            zero = engine.ds.optimizer
            if hasattr(zero, "fp32_partitioned_groups_flat"):  # ZeRO-3
                pairs = zip(zero.fp32_partitioned_groups_flat, zero.fp16_partitioned_groups_flat)
            else:  # ZeRO-1/2: the master partition and this rank's part of the flat parameters
                rank = topology.dp_rank
                pairs = zip(
                    zero.single_partition_of_fp32_groups,
                    [parts[rank] for parts in zero.parallel_partitioned_bit16_groups],
                )
            pairs = list(pairs)
            (Path(cfg.run.dir) / "zero_groups.json").write_text(
                json.dumps(
                    {
                        "partitions": [master.numel() for master, _ in pairs],
                        "sub_group_size": engine.ds.zero_sub_group_size(),
                        "master_is_the_parameter": [
                            master.data_ptr() == low.data_ptr() for master, low in pairs
                        ],
                    }
                )
            )
        return engine


class DeepSpeedFp16OnThisCpu:
    """Lets DeepSpeed run fp16 on a CPU without oneDNN fp16 kernels. DeepSpeed's CPU accelerator
    refuses fp16 there (``is_fp16_supported()`` asks oneDNN); torch's generic CPU kernels compute
    fp16 all the same, so DeepSpeed's real fp16 path (16-bit model, fp32 master weights, dynamic
    loss scaler) runs, only slower. Only the probe is replaced, in each worker; the test lifts
    plait's matching refusal in the parent (``zero.config._cpu_supports_fp16``)."""

    @hookimpl
    def plait_declare(self):
        return PluginInfo(name="deepspeed_fp16_on_this_cpu")

    @hookimpl(wrapper=True)
    def plait_build_engine(self):
        from deepspeed.accelerator import get_accelerator

        get_accelerator().is_fp16_supported = lambda: True
        return (yield)


def with_precision(precision: str, monkeypatch) -> list:
    """The plugins a DeepSpeed run in ``precision`` needs here. This CPU may lack oneDNN fp16
    kernels, and then DeepSpeed and plait refuse fp16 on it; the run lifts both checks
    (:class:`DeepSpeedFp16OnThisCpu`) so that DeepSpeed's real fp16 path runs on torch's generic
    kernels."""
    from plait.plugins.zero import config as zero_config

    if precision != "fp16" or zero_config._cpu_supports_fp16():
        return []
    monkeypatch.setattr(zero_config, "_cpu_supports_fp16", lambda: True)
    return [DeepSpeedFp16OnThisCpu()]


class OverflowAtSteps:
    """Multiplies every loss of the given steps by 1e6: finite in fp32, but once the fp16 loss
    scaler has multiplied it by its scale the gradients overflow fp16 (largest value 65504): a
    real overflow for the scaler to catch, from a loss spike rather than a planted inf. Steps
    are the engine's ``train_step`` calls (a pipeline schedule may call the loss more often than
    once per micro-batch, e.g. for its first step's shape inference)."""

    def __init__(self, *steps: int):
        self.steps, self.step = steps, 0

    @hookimpl
    def plait_declare(self):
        return PluginInfo(name="overflow_at_steps")

    @hookimpl(wrapper=True)  # around whichever loss the run chose
    def plait_build_loss(self):
        from plait.train import cross_entropy

        chosen = (yield) or cross_entropy

        def loss_fn(logits, targets):
            loss = chosen(logits, targets)
            return loss * 1e6 if self.step in self.steps else loss

        return loss_fn

    @hookimpl(wrapper=True, tryfirst=True)  # outermost: around the pipeline engine too
    def plait_build_engine(self):
        engine = yield
        train_step = engine.train_step

        def counted_train_step(micro_batches, lr):
            self.step += 1
            return train_step(micro_batches, lr)

        engine.train_step = counted_train_step
        return engine


# A 4-step run for OverflowAtSteps(2, 3), a checkpoint after each step (all kept).
OVERFLOW_RUN = ["train.steps=4", "checkpoint.every=1", "checkpoint.keep_last=0"]


def assert_steps_2_and_3_skipped(run_dir, scales: list[float]) -> None:
    """Steps 2 and 3 overflowed in fp16: their optimizer steps were skipped (the weights after
    steps 1, 2 and 3 are equal bit for bit; step 4 changed them), both were counted, and the
    dynamic loss scale went as ``scales`` says (relative to step 1's)."""
    from plait.export import export
    from plait.testing import read_metrics

    metrics = read_metrics(run_dir)
    assert [m["skipped_steps"] for m in metrics] == [0, 1, 2, 2]
    assert [m["loss_scale"] / metrics[0]["loss_scale"] for m in metrics] == scales
    weights = [
        torch.load(export(str(run_dir / "checkpoints" / f"step_{s:08d}")), weights_only=True)
        for s in range(1, 5)
    ]
    changed = [any(not torch.equal(a[k], b[k]) for k in a) for a, b in zip(weights, weights[1:])]
    assert changed == [False, False, True]  # by steps 2, 3 and 4


class OptimizerSettingsAfterLoad:
    """Writes the settings of every param group of the optimizer that steps, right after the
    checkpoint is loaded, to ``run.dir/optimizer_after_load.json`` (rank 0)."""

    @hookimpl
    def plait_declare(self):
        return PluginInfo(name="optimizer_settings_after_load")

    @hookimpl(wrapper=True)
    def plait_load_checkpoint(self, cfg, engine, topology):
        import json
        from pathlib import Path

        state = yield
        optimizer = engine.ds.optimizer if hasattr(engine, "ds") else engine.optimizer
        groups = [
            {k: v for k, v in g.items() if k in ("lr", "betas", "weight_decay", "eps")}
            for g in optimizer.param_groups
        ]
        if topology.rank == 0:
            Path(cfg.run.dir, "optimizer_after_load.json").write_text(json.dumps(groups))
        return state


class GradScalerAfterLoad:
    """Writes the state of torch's loss scaler (DDP's, also a pipeline's) right after the
    checkpoint is loaded, to ``run.dir/grad_scaler_after_load.json`` (rank 0)."""

    @hookimpl
    def plait_declare(self):
        return PluginInfo(name="grad_scaler_after_load")

    @hookimpl(wrapper=True)
    def plait_load_checkpoint(self, cfg, engine, topology):
        state = yield
        ddp = getattr(engine, "inner", engine)  # a pipeline engine wraps the DDP engine
        if topology.rank == 0:
            scaler = ddp.scaler.state_dict()
            Path(cfg.run.dir, "grad_scaler_after_load.json").write_text(
                json.dumps(
                    {
                        "scale": scaler["scale"],
                        "growth_tracker": scaler["_growth_tracker"],
                        "skipped_steps": ddp.skipped_steps,
                    }
                )
            )
        return state


class HoldWriteThenKill:
    """For ``checkpoint.async_save``, in the first attempt only: the background write of step
    ``held_step``'s checkpoint is held (a sleep injected into DCP's file writer on rank 0, so
    the kill surely lands inside the write), and rank 0 SIGKILLs itself at the end of step
    ``kill_step``, while that write is still running."""

    def __init__(self, held_step: int, kill_step: int):
        self.held_step, self.kill_step = held_step, kill_step

    @hookimpl
    def plait_declare(self):
        return PluginInfo(name="hold_write_then_kill")

    @hookimpl
    def plait_on_run_start(self):  # the logging rank: rank 0
        import time

        from torch.distributed.checkpoint.filesystem import _FileSystemWriter

        if attempt() > 0:
            return
        real, held = _FileSystemWriter.write_data, f"step_{self.held_step:08d}"

        def write_data(writer, plan, planner):
            if held in str(writer.path):
                time.sleep(300)
            return real(writer, plan, planner)

        _FileSystemWriter.write_data = write_data

    @hookimpl
    def plait_on_step_end(self, step):
        if attempt() == 0 and step == self.kill_step:
            os.kill(os.getpid(), signal.SIGKILL)


class RecordInitialWeights:
    """Writes each rank's parameters as they are right after the model is built and cut, before
    any step: ``initial_rank<r>.pt`` in ``run.dir``, ``{name: tensor}`` under the unsplit names;
    a ZeRO-3 parameter is written as its flat partition (``ds_tensor``) under ``name#zero3``, an
    FSDP one (a DTensor) as its local dim-0 shard under ``name#fsdp``."""

    @hookimpl(wrapper=True)  # the first hook after the materialization; decides nothing
    def plait_build_loss(self, cfg, model, topology):
        weights = {}
        for name, p in model.named_parameters():
            part = getattr(p, "ds_tensor", None)
            if part is not None:
                weights[f"{name}#zero3"] = part.detach()
            elif hasattr(p, "to_local"):
                weights[f"{name}#fsdp"] = p.to_local().detach()
            else:
                weights[name] = p.detach()
        torch.save(weights, Path(cfg.run.dir) / f"initial_rank{topology.rank}.pt")
        return (yield)


class RecordShards:
    """Writes, on every rank right after the model is materialized, how each parameter is held:
    ``shards_rank<r>.json`` in ``run.dir``, ``{name: {"dtensor", "mesh", "placements", "local",
    "global"}}`` (element counts), so a test can tell a sharded layout from a silent fallback."""

    @hookimpl(wrapper=True)
    def plait_build_loss(self, cfg, model, topology):
        from torch.distributed.tensor import DTensor

        held = {}
        for name, p in model.named_parameters():
            is_dtensor = isinstance(p, DTensor)
            held[name] = {
                "dtensor": is_dtensor,
                "mesh": list(p.device_mesh.shape) if is_dtensor else None,
                "mesh_dims": list(p.device_mesh.mesh_dim_names or ()) if is_dtensor else None,
                "placements": [str(x) for x in p.placements] if is_dtensor else None,
                "local": (p.to_local() if is_dtensor else p).numel(),
                "global": p.numel(),
            }
        (Path(cfg.run.dir) / f"shards_rank{topology.rank}.json").write_text(json.dumps(held))
        return (yield)


record_shards = RecordShards()  # for `+plugins=[inhouse:record_shards]` on a command line


class RecordOrigin:
    """Writes, at the run's start on the logging rank, what that worker was forked from and runs
    under: ``origin.json`` in ``run.dir``, with its parent's (the worker server's) pid and
    command line, the pid of the process that launched it (``PLAIT_AGENT_PID``), its
    ``LD_PRELOAD`` and which of tcmalloc and jemalloc are mapped into it."""

    @hookimpl
    def plait_on_run_start(self, cfg):
        server = os.getppid()
        maps = Path("/proc/self/maps").read_text()
        record = {
            "server_command": Path(f"/proc/{server}/cmdline").read_text().split("\0")[:-1],
            "server_parent": int(Path(f"/proc/{server}/stat").read_text().split(")")[1].split()[1]),
            "launcher": int(os.environ["PLAIT_AGENT_PID"]),
            "launcher_command": Path(f"/proc/{os.environ['PLAIT_AGENT_PID']}/cmdline")
            .read_text()
            .split("\0")[:-1],
            "ld_preload": os.environ.get("LD_PRELOAD"),
            "allocators": [a for a in ("libtcmalloc", "libjemalloc") if a in maps],
        }
        (Path(cfg.run.dir) / "origin.json").write_text(json.dumps(record))


record_origin = RecordOrigin()  # for `+plugins=[inhouse:record_origin]` on a command line


class ExpertProbe:
    """Mixture of experts, from inside every worker: the experts each rank holds (each MoE
    layer's expert indices), ZeRO's partition of each param group under ``strategy=zero*``, and
    per step the ``torch.distributed.all_to_all_single`` calls of the rank and the bytes they
    sent to other ranks, counted where torch.distributed is called (so experts replicated on
    every rank, with no all-to-all, show none): ``run.dir/experts_rank<r>.json`` and
    ``run.dir/alltoall_rank<r>.jsonl`` (one line per step)."""

    @hookimpl
    def plait_declare(self):
        return PluginInfo(name="expert_probe")

    @hookimpl(wrapper=True)
    def plait_build_engine(self, cfg, model, topology):
        engine = yield
        layers = {
            name: sorted(m.experts.keys(), key=int)
            for name, m in model.named_modules()
            if getattr(m, "is_moe_layer", False)
        }
        record = {"experts": layers, "zero_groups": _zero_groups(engine)}
        run_dir = Path(cfg.run.dir)
        (run_dir / f"experts_rank{topology.rank}.json").write_text(json.dumps(record))
        return AllToAllCounting(engine, run_dir / f"alltoall_rank{topology.rank}.jsonl")


def _zero_groups(engine) -> list[dict]:
    """Each param group of DeepSpeed's ZeRO optimizer: expert (``moe``) or not, how many
    partitions it is cut into, and its elements."""
    if not hasattr(engine, "ds"):
        return []
    zero = engine.ds.optimizer
    return [
        {
            "moe": bool(group.get("moe", False)),
            "partitions": zero.partition_count[i],
            "numel": sum(p.numel() for p in zero.bit16_groups[i]),
        }
        for i, group in enumerate(zero.optimizer.param_groups)
    ]


class AllToAllCounting:
    def __init__(self, engine, path):
        self.engine, self.path, self.calls, self.bytes = engine, path, 0, 0
        original = dist.all_to_all_single

        def counting(
            output,
            input,
            output_split_sizes=None,
            input_split_sizes=None,
            group=None,
            async_op=False,
        ):
            rows = input_split_sizes or [
                input.shape[0] // dist.get_world_size(group)
            ] * dist.get_world_size(group)
            row_bytes = (
                input[:1].numel() * input.element_size()
                if input.dim() > 1
                else input.element_size()
            )
            self.calls += 1
            self.bytes += (sum(rows) - rows[dist.get_rank(group)]) * row_bytes
            return original(output, input, output_split_sizes, input_split_sizes, group, async_op)

        dist.all_to_all_single = counting

    def train_step(self, micro_batches, lr):
        out = self.engine.train_step(micro_batches, lr)
        with open(self.path, "a") as f:
            f.write(json.dumps({"calls": self.calls, "bytes": self.bytes}) + "\n")
        self.calls = self.bytes = 0
        return out

    def __getattr__(self, name):
        return getattr(self.engine, name)


def read_expert_probe(run_dir) -> tuple[dict[int, dict], dict[int, list[dict]]]:
    """``(experts and ZeRO groups by rank, all-to-all counts per step by rank)``."""
    run_dir = Path(run_dir)
    held = {
        int(p.stem.removeprefix("experts_rank")): json.loads(p.read_text())
        for p in run_dir.glob("experts_rank*.json")
    }
    counts = {
        int(p.stem.removeprefix("alltoall_rank")): [
            json.loads(line) for line in p.read_text().splitlines()
        ]
        for p in run_dir.glob("alltoall_rank*.jsonl")
    }
    return held, counts


class RecordLayout:
    """Proof that a layout happened, not only equal losses: on every rank, right before the
    engine is built, the shape of every parameter the rank holds (the model after tensor-parallel
    cutting and pipeline splitting, under the unsplit names) and the ranks of its dp, tp and pp
    groups; then the groups every collective of the first step ran over (the ranks handed to
    ``torch.distributed``'s collectives, and the peer of every pipeline send or receive: each
    ``P2POp`` a stage makes). Written
    to ``run.dir/layout_rank<r>.json``; :func:`assert_layout` reads them. A run that silently
    stayed plain data parallel holds whole parameters and sends nothing over a tp group."""

    COLLECTIVES = (
        "all_reduce",
        "all_gather",
        "all_gather_into_tensor",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "broadcast",
        "all_to_all_single",
    )

    @hookimpl
    def plait_declare(self):
        return PluginInfo(name="record_layout")

    @hookimpl(wrapper=True, tryfirst=True)  # outermost: the first step of the whole engine
    def plait_build_engine(self, cfg, model, topology):
        record = {
            "params": {name: list(p.shape) for name, p in model.named_parameters()},
            "groups": {
                axis: dist.get_process_group_ranks(topology.group(axis))
                for axis in ("dp", "tp", "pp")
            },
        }
        engine = yield
        used: set[tuple[str, tuple[int, ...]]] = set()
        path = Path(cfg.run.dir) / f"layout_rank{topology.rank}.json"
        train_step = engine.train_step

        def first_step(*args, **kwargs):
            originals = {name: getattr(dist, name) for name in (*self.COLLECTIVES, "P2POp")}
            for name in self.COLLECTIVES:
                setattr(dist, name, _recording_group(originals[name], name, used))
            dist.P2POp = _recording_peers(originals["P2POp"], topology.rank, used)
            try:
                return train_step(*args, **kwargs)
            finally:
                for name, fn in originals.items():
                    setattr(dist, name, fn)
                engine.train_step = train_step
                record["used"] = sorted([kind, list(ranks)] for kind, ranks in used)
                path.write_text(json.dumps(record))

        engine.train_step = first_step
        return engine


record_layout = RecordLayout()  # for `+plugins=[inhouse:record_layout]` on a command line


def _group_ranks(group) -> tuple[int, ...]:
    from plait.plugins.comm.algorithm import AlgorithmGroup

    if isinstance(group, AlgorithmGroup):  # comm=ring|hierarchical: the group it runs over
        group = group.group
    return tuple(
        dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size())
    )


def _recording_group(fn, kind: str, used: set):
    import inspect

    signature = inspect.signature(fn)

    def collective(*args, **kwargs):
        group = signature.bind(*args, **kwargs).arguments.get("group")
        used.add(("collective", _group_ranks(group)))
        return fn(*args, **kwargs)

    return collective


def _recording_peers(p2p_op, rank: int, used: set):
    """``torch.distributed.P2POp`` noting the peer of every point-to-point op made (a pipeline
    stage makes one per send and receive, batched or not)."""

    class RecordingP2POp(p2p_op):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            used.add(("p2p", tuple(sorted((rank, self.peer)))))

    return RecordingP2POp


def whole_model_shapes(run_dir) -> dict[str, list[int]]:
    """Parameter name -> shape of a 1-process run's model (``RecordLayout``'s record)."""
    return json.loads((Path(run_dir) / "layout_rank0.json").read_text())["params"]


def assert_layout(
    run_dir, full: dict[str, list[int]], *, dp: int, tp: int = 1, pp: int = 1
) -> None:
    """The run's ranks (``RecordLayout``) were the ``(pp, dp, tp)`` mesh and worked as it:

    - each rank's dp, tp and pp groups are the mesh's (rank = (pp_i·dp + dp_i)·tp + tp_i);
    - in the first step it ran collectives over its own tp group (tensor-parallel regions) and
      its own dp group (the gradient average), and pipeline sends only to the ranks of the
      stages before and after its own (in a ring: interleaved stages wrap around);
    - every parameter it holds is the unsplit one (``full``: name -> shape) or, under tp, that
      one cut to 1/tp along one dim, the same on every rank of its tp group, and at least one is
      cut; the stages of a pp group hold disjoint parameters that together make the model.
    """
    width = dp * tp
    layouts = [
        json.loads((Path(run_dir) / f"layout_rank{r}.json").read_text()) for r in range(width * pp)
    ]
    for r, layout in enumerate(layouts):
        pp_i, dp_i, tp_i = r // width, r % width // tp, r % tp
        groups = {
            "dp": [pp_i * width + d * tp + tp_i for d in range(dp)],
            "tp": [pp_i * width + dp_i * tp + t for t in range(tp)],
            "pp": [p * width + dp_i * tp + tp_i for p in range(pp)],
        }
        assert layout["groups"] == groups, (r, layout["groups"])
        used = {(kind, tuple(ranks)) for kind, ranks in layout["used"]}
        for axis, size in (("tp", tp), ("dp", dp)):
            if size > 1:
                assert ("collective", tuple(groups[axis])) in used, (r, axis, sorted(used))
        peers = {ranks for kind, ranks in used if kind == "p2p"}
        neighbours = {
            tuple(sorted((r, groups["pp"][(pp_i + step) % pp]))) for step in (-1, 1) if pp > 1
        }
        assert peers <= neighbours and bool(peers) == (pp > 1), (r, peers)
        cut = 0
        for name, shape in layout["params"].items():
            whole = full[name]
            if shape == whole:
                continue
            dims = [i for i, (a, b) in enumerate(zip(shape, whole)) if a != b]
            assert len(shape) == len(whole) and len(dims) == 1, (r, name, shape, whole)
            assert shape[dims[0]] * tp == whole[dims[0]], (r, name, shape, whole)
            cut += 1
        assert (cut > 0) == (tp > 1), (r, cut)
        for q in groups["tp"]:
            assert layouts[q]["params"] == layout["params"], (r, q)
    for r in range(width):  # each pp group: its stages split the model between them
        names = [set(layouts[q]["params"]) for q in range(r, width * pp, width)]
        assert sum(map(len, names)) == len(set().union(*names)) == len(full), (r, names)


class RecordCompiled:
    """Whether the model the engine steps was compiled, and what TorchDynamo captured in the
    first step (``torch._dynamo.utils.counters``): ``run.dir/compiled_rank<r>.json``."""

    @hookimpl
    def plait_declare(self):
        return PluginInfo(name="record_compiled")

    @hookimpl(wrapper=True, tryfirst=True)
    def plait_build_engine(self, cfg, topology):
        engine = yield

        def write():
            from torch._dynamo.eval_frame import OptimizedModule
            from torch._dynamo.utils import counters

            Path(cfg.run.dir, f"compiled_rank{topology.rank}.json").write_text(
                json.dumps(
                    {
                        "wrapper": type(getattr(engine, "wrapped", engine.model)).__name__,
                        "optimized_module": isinstance(
                            getattr(engine, "wrapped", None), OptimizedModule
                        ),
                        "unique_graphs": counters["stats"]["unique_graphs"],
                    }
                )
            )

        after_first_step(engine, write)
        return engine


class RecordFirstBatch:
    """Writes the micro-batches of the first step on rank 0 (``run.dir/first_batch.pt``:
    ``[(inputs, targets), ...]``), outermost around the engine, what the loop feeds."""

    @hookimpl(wrapper=True, tryfirst=True)
    def plait_build_engine(self, cfg, topology):
        engine = yield
        if topology.rank == 0:
            train_step, path = engine.train_step, Path(cfg.run.dir) / "first_batch.pt"

            def first_step(micro_batches, lr):  # stays in place: other plugins may wrap it too
                if not path.exists():
                    torch.save([(x.clone(), y.clone()) for x, y in micro_batches], path)
                return train_step(micro_batches, lr)

            engine.train_step = first_step
        return engine


class RecordHeld:
    """What each rank holds after its first step: ``held_rank<r>.json`` in ``run.dir`` with
    ``params`` (``{name: elements this rank holds}``: a ZeRO-3 partition's, an FSDP shard's, a
    tensor-parallel shard's) and ``optimizer_elements`` (the Adam first moments this rank's
    optimizer keeps: a ZeRO partition holds a share of its stage's)."""

    @hookimpl(wrapper=True, tryfirst=True)  # outermost: the engine the loop steps (a pipeline's)
    def plait_build_engine(self, cfg, topology):
        engine = yield

        def record():
            params = {}
            for name, p in engine.model.named_parameters():
                part = getattr(p, "ds_tensor", None)
                local = (
                    part if part is not None else (p.to_local() if hasattr(p, "to_local") else p)
                )
                params[name] = local.numel()
            inner = getattr(engine, "inner", engine)
            optimizer = inner.ds.optimizer.optimizer if hasattr(inner, "ds") else inner.optimizer
            moments = [s["exp_avg"] for s in optimizer.state.values() if "exp_avg" in s]
            moments = [m.to_local() if hasattr(m, "to_local") else m for m in moments]  # FSDP
            record = {"params": params, "optimizer_elements": sum(m.numel() for m in moments)}
            (Path(cfg.run.dir) / f"held_rank{topology.rank}.json").write_text(json.dumps(record))

        after_first_step(engine, record)
        return engine


class RecordReads:
    """Counts the checkpoint elements each rank reads while its model is built (``model=hf``:
    ``CheckpointFiles.read``), into ``reads_rank<r>.json`` in ``run.dir``: ``{"elements"}``."""

    @hookimpl(wrapper=True, tryfirst=True)
    def plait_build_model(self):
        from plait.plugins.hf.checkpoint_files import CheckpointFiles

        if not hasattr(CheckpointFiles, "plait_elements_read"):
            read = CheckpointFiles.read

            def counting_read(files, name, box=None, dtype=torch.float32):
                value = read(files, name, box, dtype)
                CheckpointFiles.plait_elements_read += value.numel()
                return value

            CheckpointFiles.read = counting_read
        CheckpointFiles.plait_elements_read = 0
        return (yield)

    @hookimpl(wrapper=True)
    def plait_build_loss(self, cfg, topology):
        from plait.plugins.hf.checkpoint_files import CheckpointFiles

        (Path(cfg.run.dir) / f"reads_rank{topology.rank}.json").write_text(
            json.dumps({"elements": CheckpointFiles.plait_elements_read})
        )
        return (yield)


class LayerListLM(torch.nn.Module):
    """A user's own model with no plan and no plugin: an embedding, a ``ModuleList`` of residual
    MLP layers, a norm and a head (``pipeline.layers=layers`` cuts it into stages)."""

    def __init__(self, vocab_size: int = 256, width: int = 32, n_layers: int = 4):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab_size, width)
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(
                torch.nn.Linear(width, 2 * width),
                torch.nn.GELU(),
                torch.nn.Linear(2 * width, width),
            )
            for _ in range(n_layers)
        )
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, vocab_size)

    def forward(self, x):
        x = self.embed(x)
        for layer in self.layers:
            x = x + layer(x)
        return self.head(self.norm(x))


class ReplicaGroupProbe:
    """For ``fault=torchft``: what each rank of each replica group did, in ``run.dir/probe``.

    Per group ``g`` and rank ``r`` (its rank in the group's torch job), ``g<g>r<r>.jsonl`` gets a
    line per step taken (``step``, ``pid``, ``attempt``: torch elastic's restart count) and one
    per call of the checkpoint loader (``load``: the attempt); after the last step
    ``g<g>r<r>.pt`` holds the rank's own state (``engine.local_state()``: model, optimizer).
    With ``kill_at``: rank ``kill_rank`` of group ``kill_group``
    SIGKILLs itself as its step ``kill_at`` starts (after the step's quorum, before its forward,
    so the survivors' collectives of that step fail), once; its restart builds its engine (and
    its torchft manager, whose heartbeats make the lighthouse wait for it) only once group 0 has
    finished that step, without it: a restart quicker than the quorum's join timeout would
    otherwise be back in the step's retried quorum, and group 0 never alone. With ``hold_at``:
    group 0 waits after step ``hold_at`` until the killed group's restart asks for its first
    quorum (so it surely rejoins before the run ends)."""

    def __init__(self, kill_at=None, kill_group=1, kill_rank=1, hold_at=None):
        self.kill_at, self.hold_at = kill_at, hold_at
        self.kill_group, self.kill_rank = kill_group, kill_rank
        self.engine = None

    @hookimpl
    def plait_declare(self):
        return PluginInfo(name="replica_group_probe")

    @staticmethod
    def _directory(cfg) -> Path:
        directory = Path(cfg.run.dir) / "probe"
        directory.mkdir(parents=True, exist_ok=True)
        return directory

    def _record(self, cfg, topology, line: dict) -> None:
        name = f"g{topology.replica_group_id}r{topology.rank}.jsonl"
        with open(self._directory(cfg) / name, "a") as f:
            f.write(json.dumps(line) + "\n")

    @staticmethod
    def _wait_for(path: Path, seconds: float = 120.0) -> None:
        import time

        deadline = time.monotonic() + seconds
        while not path.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{path} did not appear within {seconds} s")
            time.sleep(0.05)

    @hookimpl(wrapper=True)
    def plait_build_engine(self, cfg, topology):
        restarted = self.kill_at is not None and topology.replica_group_id == self.kill_group
        if restarted and attempt() > 0:  # before its manager exists: no heartbeat, no quorum
            self._wait_for(self._directory(cfg) / "g0_finished_the_killed_step")
        engine = yield
        self.engine = engine
        killing = (
            self.kill_at is not None
            and topology.replica_group_id == self.kill_group
            and topology.rank == self.kill_rank
            and attempt() == 0
        )
        if killing:
            step, calls = engine.train_step, itertools.count(1)

            def train_step(micro_batches, lr):
                if next(calls) == self.kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)
                return step(micro_batches, lr=lr)

            engine.train_step = train_step
        return engine

    @hookimpl(wrapper=True)
    def plait_sync_replicas(self, cfg, state, topology):
        directory, group = self._directory(cfg), topology.replica_group_id
        if state is None:  # the attempt's first quorum
            (directory / f"at_first_quorum_g{group}_a{attempt()}").touch()
        elif group == 0 and state.step == self.hold_at:
            self._wait_for(directory / f"at_first_quorum_g{self.kill_group}_a1")
        return (yield)

    @hookimpl(wrapper=True)
    def plait_load_checkpoint(self, cfg, topology):
        self._record(cfg, topology, {"load": attempt()})
        return (yield)

    @hookimpl(wrapper=True)
    def plait_save_checkpoint(self, cfg, state, topology, final):
        written = yield
        self._record(cfg, topology, {"step": state.step, "pid": os.getpid(), "attempt": attempt()})
        if topology.replica_group_id == 0 and state.step == self.kill_at:
            (self._directory(cfg) / "g0_finished_the_killed_step").touch()
        if final:
            name = f"g{topology.replica_group_id}r{topology.rank}.pt"
            torch.save(self.engine.local_state(), self._directory(cfg) / name)
        return written


def read_probe(run_dir, group: int, rank: int) -> list[dict]:
    path = Path(run_dir) / "probe" / f"g{group}r{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]
