"""In-house plugins used by the tests, loaded the way users load theirs (dotted paths, objects)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
from pathlib import Path
from types import SimpleNamespace

from plait import hookimpl
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
        import torch.distributed as dist

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
    one JSON line per step in ``<directory>/rank<r>-<pid>.jsonl``; with ``kill_at``, rank 0
    SIGKILLs its own process after that step (a real worker death, before the step's
    checkpoint)."""

    def __init__(self, directory, kill_at=None):
        self.directory, self.kill_at = str(directory), kill_at

    @hookimpl
    def plait_declare(self):
        return PluginInfo(name="record_batches")

    @hookimpl(wrapper=True)
    def plait_build_engine(self, topology):
        engine = yield
        return RecordingEngine(engine, self.directory, topology.rank, self.kill_at)


class RecordingEngine:
    def __init__(self, engine, directory, rank, kill_at):
        self.engine, self.rank, self.kill_at, self.steps = engine, rank, kill_at, 0
        self.path = Path(directory) / f"rank{rank}-{os.getpid()}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def train_step(self, micro_batches, lr):
        rows = [hashlib.sha1(row.numpy().tobytes()).hexdigest()[:16]
                for x, _ in micro_batches for row in x]
        with open(self.path, "a") as f:
            f.write(json.dumps(rows) + "\n")
        out = self.engine.train_step(micro_batches, lr)
        self.steps += 1
        if self.rank == 0 and self.steps == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    def __getattr__(self, name):
        return getattr(self.engine, name)


def recorded_steps(directory, rank):
    """Each recorded step's rows of ``rank``, files in the order they were written."""
    files = sorted(Path(directory).glob(f"rank{rank}-*.jsonl"), key=lambda p: p.stat().st_mtime)
    return [[json.loads(line) for line in f.read_text().splitlines()] for f in files]


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


class NanLoss:
    """Makes the loss NaN on global rank ``rank`` for the engine's optimizer-step calls
    ``first .. first+count-1`` of the first attempt. Every rank records, for each poisoned call,
    whether the engine skipped it and whether parameters and optimizer state stayed the same
    bytes: ``directory/skip_rank<r>_call<n>.json``."""

    def __init__(self, directory, first: int, count: int, rank: int = 1):
        self.directory, self.first, self.count, self.rank = str(directory), first, count, rank

    @hookimpl
    def plait_declare(self):
        return PluginInfo(name="nan_loss")

    @hookimpl(wrapper=True)
    def plait_build_engine(self, topology):
        import itertools

        engine = yield
        if attempt() > 0:
            return engine
        calls, inner_step, inner_loss = itertools.count(1), engine.train_step, engine.loss_fn

        def train_step(micro_batches, lr):
            n = next(calls)
            poisoned = self.first <= n < self.first + self.count
            nan = poisoned and topology.rank == self.rank
            engine.loss_fn = (lambda y, t: inner_loss(y, t) * float("nan")) if nan else inner_loss
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
    """Parameters and optimizer state as flat ``name -> tensor`` copies."""
    import torch

    flat = {f"model.{k}": v.detach().clone() for k, v in engine.model.state_dict().items()}
    for pid, state in engine.optimizer.state_dict()["state"].items():
        for k, v in state.items():
            flat[f"optim.{pid}.{k}"] = v.clone() if isinstance(v, torch.Tensor) else torch.tensor(v)
    return flat


def torch_equal(a, b) -> bool:
    import torch

    return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))


class Rank0:
    """The topology of a one-process run, as far as saving reads it."""

    rank = 0
    is_logging_rank = True
    trainer_group = None
    local_rank = local_trainer_rank = 0
    dims = SimpleNamespace(dp=1, tp=1, pp=1)


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
