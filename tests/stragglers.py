"""In-test plugins that make a rank slow, a victim, or stuck (tests/test_report.py,
tests/test_lost_nodes.py); loaded as users load theirs (objects, dotted paths)."""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
from collections import deque
from pathlib import Path

import torch

from plait import hookimpl
from plait.types import CommSpec

RECENT = 5  # steps of the others' compute a slow rank takes the median of


def busy(seconds: float) -> None:
    """Keep this thread on the CPU for ``seconds`` of its own CPU time."""
    until = time.thread_time() + seconds
    while time.thread_time() < until:
        pass


class TwiceAsLong:
    """Hooks on one rank's engine that make a slow rank compute twice as long as the others, on
    the clock the straggler detector reads on a CPU: the CPU time of the rank's thread.

    Every rank reads its thread's CPU time for each forward and backward (the forward's start to
    the last gradient) and for each optimizer step; every rank but the slow ones writes its last
    ``RECENT`` steps' figures, its first step left out (one-time costs), into
    ``folder/compute_rank<r>`` (a test's ranks share a filesystem, network namespaces included).
    At its last gradient and after its optimizer step, a slow rank stays busy for as long as the
    others' median figure for that part (its own time, before any is written): its own work,
    then the others' time again. The math is unchanged.

    Not twice the work: on a host whose ranks share cores, the second half of a rank's doubled
    forward and backward runs partly while the other rank waits in the all-reduce, with the cores
    to itself, and so faster. A rank computing every forward twice read 1.74-2.08x here and under
    1.5x for 7 logged steps on a CI host (2026-12-01). Nor twice its own time: the same work took
    one process up to a fifth more CPU time than another, for the process's life (1.52-2.37x in
    25 runs here). Nor twice the others' recent figures: a rank's time for a step moves by a
    third from one step to the next and falls over the first steps (tests/test_lost_nodes.py's
    exclude test read 2.50-2.54x in 3 of 5 runs). Its own time plus the others' halves both
    errors (1.64-2.18x in 7 runs of tests/test_report.py, 1.90-1.98x in 4 of the exclude test). The
    extra time falls while the others wait for the gradients' all-reduce (not after the forward,
    where a busy loop beside the others' backward slowed them). Registered inside the phase
    clock's ``plait_build_engine`` wrapper (``plugins/fault/phases.py``, the outermost), so these
    hooks run before the clock's: the extra time is inside the backward and the optimizer step.
    """

    def __init__(self, engine, folder: Path, rank: int, slow: bool):
        params = [p for p in engine.model.parameters() if p.requires_grad]
        self.total_grads = len(params)
        self.mine, self.folder, self.slow = folder / f"compute_rank{rank}", folder, slow
        self.started, self.grads, self.steps = 0.0, 0, 0
        self.recent = {part: deque(maxlen=RECENT) for part in ("forward_backward", "optimizer")}
        folder.mkdir(parents=True, exist_ok=True)
        engine.model.register_forward_pre_hook(self._forward_start)
        for param in params:
            param.register_post_accumulate_grad_hook(self._grad_ready)
        engine.optimizer.register_step_pre_hook(self._start)
        engine.optimizer.register_step_post_hook(self._optimizer_end)

    def _start(self, *hook_args) -> None:
        self.started = time.thread_time()

    def _forward_start(self, module, args) -> None:
        if torch.is_grad_enabled():
            self._start()
            self.grads = 0

    def _grad_ready(self, param) -> None:
        self.grads += 1
        if self.grads == self.total_grads:
            self._took("forward_backward")

    def _optimizer_end(self, *hook_args) -> None:
        self._took("optimizer")
        self.steps += 1
        if not self.slow and self.steps > 1:
            written = self.mine.with_suffix(".new")
            written.write_text(json.dumps({part: list(v) for part, v in self.recent.items()}))
            os.replace(written, self.mine)

    def _took(self, part: str) -> None:
        took = time.thread_time() - self.started
        if self.slow:
            others = [
                seconds
                for path in self.folder.glob("compute_rank*")
                if path.suffix == "" and path != self.mine
                for seconds in json.loads(path.read_text())[part]
            ]
            busy(statistics.median(others) if others else took)
        elif self.steps > 0:
            self.recent[part].append(took)


def slowed(engine, cfg, topology, slow: bool):
    """``engine`` with ``TwiceAsLong``'s hooks, its folder in the run's directory."""
    TwiceAsLong(engine, Path(cfg.run.dir) / "step_compute", topology.rank, slow)
    return engine


class SlowRanks:
    """Global ranks ``ranks`` compute twice as long as the others (``TwiceAsLong``). Registered
    on every rank."""

    def __init__(self, ranks):
        self.ranks = set(ranks)

    @hookimpl(wrapper=True)
    def plait_build_engine(self, cfg, topology):
        return slowed((yield), cfg, topology, topology.rank in self.ranks)


class DelayedReducer:
    """The comm plugin's reducer, with each bucket's result handed over ``seconds`` later (the
    all-reduce itself is not delayed: the wait is)."""

    def __init__(self, reducer, seconds: float):
        self.reducer, self.seconds = reducer, seconds
        self.spec = CommSpec(algorithm="delayed_wait")  # not native: DDP calls reduce()

    def reduce(self, bucket, group):
        inner = self.reducer.reduce(bucket, group)
        if not self.seconds:
            return inner
        result = torch.futures.Future()

        def later(done):
            threading.Timer(self.seconds, result.set_result, [done.value()]).start()

        inner.add_done_callback(later)
        return result


class SlowWait:
    """Global rank ``rank`` receives its gradient all-reduce ``seconds`` late: a victim that waits
    longer in the collective, not a rank that computes slower. Every rank runs the same reducer
    path (so the math is the same on every rank); only ``rank`` waits."""

    def __init__(self, rank: int, seconds: float):
        self.rank, self.seconds = rank, seconds

    @hookimpl(wrapper=True)
    def plait_grad_reducer(self, topology):
        reducer = yield
        return DelayedReducer(reducer, self.seconds if topology.rank == self.rank else 0.0)


class StopEntering:
    """Global rank ``rank`` stops entering collectives at its ``step``-th training forward: it
    writes the time into ``run.dir/stopped_at`` and sleeps (alive, never arriving)."""

    def __init__(self, rank: int, step: int):
        self.rank, self.step, self.forwards = rank, step, 0

    @hookimpl
    def plait_apply_tensor_parallel(self, cfg, model, topology):
        if topology.rank == self.rank:
            path = Path(cfg.run.dir) / "stopped_at"
            model.register_forward_pre_hook(lambda module, args: self._maybe_stop(path))

    def _maybe_stop(self, path: Path) -> None:
        if not torch.is_grad_enabled():
            return
        self.forwards += 1
        if self.forwards == self.step:
            path.write_text(f"{time.time()}\n")
            time.sleep(3600)


stop_rank1_at_step3 = StopEntering(1, 3)  # +plugins=[stragglers:stop_rank1_at_step3]


class SlowNode:
    """Every rank of node ``node`` (``GROUP_RANK``) computes twice as long as the others: a
    straggling node."""

    def __init__(self, node: int):
        self.node = node

    @hookimpl(wrapper=True)
    def plait_build_engine(self, cfg, topology):
        return slowed((yield), cfg, topology, topology.node_rank == self.node)


slow_node1 = SlowNode(1)  # +plugins=[stragglers:slow_node1]


class PauseAfter:
    """In the first attempt, every rank stops after step ``step``'s checkpoint; each node's first
    rank writes ``run.dir/paused_node<k>``, and all wait for ``run.dir/go`` (the test's cue that it
    has done what it does to the job: cut a link) before they go on."""

    def __init__(self, step: int):
        self.step = step

    @hookimpl(wrapper=True)
    def plait_save_checkpoint(self, cfg, state, topology):
        written = yield
        if state.step == self.step and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            run = Path(cfg.run.dir)
            if topology.local_rank == 0:
                (run / f"paused_node{topology.node_rank}").write_text(f"{time.time()}\n")
            while not (run / "go").exists():
                time.sleep(0.05)
        return written


pause_after_step_4 = PauseAfter(4)  # +plugins=[stragglers:pause_after_step_4]


class ExtraForwardsGroup:
    """Every rank of replica group ``group`` (``fault=torchft``) runs ``extra`` more forwards of
    each micro-batch without gradients: its compute grows by up to ``extra + 1`` times, its math
    not at all (the extra outputs are dropped). A wider margin over the factor than computing
    twice, whose 1.4-1.6x over a tiny model's whole step a busy 2-core host blurs."""

    def __init__(self, group: int, extra: int):
        self.group, self.extra = group, extra

    @hookimpl
    def plait_apply_tensor_parallel(self, model, topology):
        if topology.replica_group_id == self.group:
            model.register_forward_hook(self._again)

    def _again(self, module, args, output):
        with torch.no_grad():
            for _ in range(self.extra):
                module.forward(*args)
