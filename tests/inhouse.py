"""In-house plugins used by the tests, loaded the way users load theirs (dotted paths, objects)."""

from __future__ import annotations

import collections
import hashlib
import itertools
import json
import os
import signal
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
        return PluginInfo(name="fp32_only", precisions=frozenset({"fp32"}),
                          parallel_axes=frozenset({"dp"}))


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
        record = {"rank": topology.rank, "local_rank": topology.local_rank,
                  "device": str(next(engine.model.parameters()).device),
                  "backend": dist.get_backend(), "world_size": dist.get_world_size()}
        Path(self.directory, f"placement_rank{topology.rank}.json").write_text(json.dumps(record))
        return engine


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
        rows = [[hashlib.sha1(row.numpy().tobytes()).hexdigest()[:16] for row in x]
                for x, _ in micro_batches]
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
hold_node1_after_step_4 = HoldAfter("hold_node1", 4, "node1_held",
                                    lambda topology: attempt() == 0 and topology.node_rank == 1)
# A node training alone (the world is its own processes): the cue to start a second node, whose
# arrival makes torch elastic's agent restart the group to take it in, which ends the wait.
hold_alone_after_step_2 = HoldAfter(
    "hold_alone", 2, "node0_alone_held",
    lambda topology: os.environ.get("WORLD_SIZE") == os.environ.get("LOCAL_WORLD_SIZE"))


class NanLoss:
    """Makes the loss (``what="loss"``) or the gradient of this rank's first parameter
    (``what="grad"``) NaN on global rank ``rank`` for the engine's optimizer-step calls
    ``first .. first+count-1`` of the first attempt. Every rank records, for each poisoned call,
    whether the engine skipped it and whether parameters and optimizer state stayed the same
    bytes: ``directory/skip_rank<r>_call<n>.json``. Works under every engine: the loss through
    ``engine.loss_fn`` (DDP, ZeRO), the gradient through a tensor hook (also inside a pipeline
    schedule, which holds its own loss function)."""

    def __init__(self, directory, first: int, count: int, rank: int = 1, what: str = "loss"):
        self.directory, self.first, self.count, self.rank = str(directory), first, count, rank
        self.what = what

    @hookimpl
    def plait_declare(self):
        return PluginInfo(name="nan_loss")

    @hookimpl(wrapper=True, tryfirst=True)  # outermost: around the pipeline engine too
    def plait_build_engine(self, topology):
        engine = yield
        if attempt() > 0:
            return engine
        calls, inner_step, inner_loss = itertools.count(1), engine.train_step, engine.loss_fn
        nan = [False]
        if self.what == "grad":
            first_param = next(engine.model.parameters())
            first_param.register_hook(lambda g: g * float("nan") if nan[0] else g)

        def train_step(micro_batches, lr):
            n = next(calls)
            poisoned = self.first <= n < self.first + self.count
            nan[0] = poisoned and topology.rank == self.rank
            if self.what == "loss":
                engine.loss_fn = ((lambda y, t: inner_loss(y, t) * float("nan")) if nan[0]
                                  else inner_loss)
            before = snapshot(engine) if poisoned else None
            out = inner_step(micro_batches, lr)
            if poisoned:
                after = snapshot(engine)
                same = before.keys() == after.keys() and all(
                    torch_equal(before[k], after[k]) for k in before)
                Path(self.directory, f"skip_rank{topology.rank}_call{n}.json").write_text(
                    json.dumps({"skipped": out.skipped, "unchanged": same}))
            return out

        engine.train_step = train_step
        return engine


def snapshot(engine) -> dict:
    """Parameters (this rank's partition under ZeRO-3, ``ds_tensor``), buffers, the optimizer's
    own parameters (DeepSpeed's fp32 master partitions under ZeRO) and optimizer state, as flat
    ``name -> tensor`` copies."""
    import torch

    model = engine.model
    flat = {f"model.{k}": getattr(v, "ds_tensor", v).detach().clone()
            for k, v in [*model.named_parameters(), *model.named_buffers()]}
    optimizer = engine.optimizer
    for g, group in enumerate(optimizer.param_groups):
        for i, param in enumerate(group["params"]):
            flat[f"optim.{g}.{i}"] = param.detach().clone()
            for k, v in optimizer.state.get(param, {}).items():
                flat[f"optim.{g}.{i}.{k}"] = (v.clone() if isinstance(v, torch.Tensor)
                                              else torch.tensor(v))
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
    local_rank = local_trainer_rank = node_rank = 0
    dims = SimpleNamespace(dp=1, tp=1, pp=1)


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
            self.counter.take()       # copy joins tp shards) are not the next step's
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
    forward, backward, weight = (stage.forward_one_chunk, stage.backward_one_chunk,
                                 stage.backward_weight_one_chunk)
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
            after_first_step(engine, lambda: path.write_text(json.dumps(
                _describe_zero_optimizer(engine.ds.optimizer))))
        return engine


def _describe_zero_optimizer(zero_optimizer) -> dict:
    inner = zero_optimizer.optimizer
    states = [t for state in inner.state.values() for t in state.values()
              if isinstance(t, torch.Tensor) and t.dim() > 0]
    return {"stepping": type(inner).__name__,
            "offload_optimizer": bool(getattr(zero_optimizer, "offload_optimizer", False)),
            "offload_param": bool(getattr(zero_optimizer, "offload_param", False)),
            "state_devices": sorted({t.device.type for t in states})}


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
                pairs = zip(zero.single_partition_of_fp32_groups,
                            [parts[rank] for parts in zero.parallel_partitioned_bit16_groups])
            pairs = list(pairs)
            (Path(cfg.run.dir) / "zero_groups.json").write_text(json.dumps({
                "partitions": [master.numel() for master, _ in pairs],
                "sub_group_size": engine.ds.zero_sub_group_size(),
                "master_is_the_parameter": [master.data_ptr() == low.data_ptr()
                                            for master, low in pairs]}))
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
OVERFLOW_RUN = ["train.steps=4", "fault.checkpoint_every=1", "fault.keep_last=0"]


def assert_steps_2_and_3_skipped(run_dir, scales: list[float]) -> None:
    """Steps 2 and 3 overflowed in fp16: their optimizer steps were skipped (the weights after
    steps 1, 2 and 3 are equal bit for bit; step 4 changed them), both were counted, and the
    dynamic loss scale went as ``scales`` says (relative to step 1's)."""
    from plait.export import export
    from plait.testing import read_metrics

    metrics = read_metrics(run_dir)
    assert [m["skipped_steps"] for m in metrics] == [0, 1, 2, 2]
    assert [m["loss_scale"] / metrics[0]["loss_scale"] for m in metrics] == scales
    weights = [torch.load(export(str(run_dir / "checkpoints" / f"step_{s:08d}")),
                          weights_only=True) for s in range(1, 5)]
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
        groups = [{k: v for k, v in g.items() if k in ("lr", "betas", "weight_decay", "eps")}
                  for g in optimizer.param_groups]
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
            Path(cfg.run.dir, "grad_scaler_after_load.json").write_text(json.dumps(
                {"scale": scaler["scale"], "growth_tracker": scaler["_growth_tracker"],
                 "skipped_steps": ddp.skipped_steps}))
        return state


class HoldWriteThenKill:
    """For ``fault.async_save``, in the first attempt only: the background write of step
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
                "local": (p.to_local() if is_dtensor else p).numel(), "global": p.numel()}
        (Path(cfg.run.dir) / f"shards_rank{topology.rank}.json").write_text(json.dumps(held))
        return (yield)


record_shards = RecordShards()  # for `+plugins=[inhouse:record_shards]` on a command line
