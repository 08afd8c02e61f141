"""In-test plugins that make a rank slow, a victim, or stuck (tests/test_report.py,
tests/test_lost_nodes.py); loaded as users load theirs (objects, dotted paths)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import torch

from plait import hookimpl
from plait.types import CommSpec


def busy(seconds: float) -> None:
    """Keep this thread on the CPU for ``seconds`` of its own CPU time."""
    until = time.thread_time() + seconds
    while time.thread_time() < until:
        pass


class TwiceAsLong:
    """Hooks that make one engine's step compute twice as long on its rank's own CPU clock
    (``time.thread_time``, what the straggler detector judges on a CPU): at its last gradient the
    thread stays busy for as long again as its forward and backward took, and after the optimizer
    step for as long again as that took. The math is unchanged.

    Not twice the work, and not busy after the forward: where the ranks share a host's cores, a
    rank's CPU time for the same work depends on what the other cores run. Work (or a busy loop)
    beside the other rank's forward slows that rank, and the slow rank's own work, when it runs
    while the other waits, runs faster: a rank computing every forward twice read 1.74-2.08x here
    and under 1.5x for 7 logged steps on a CI host (2026-12-01); busy after its forward and after
    its backward, 1.46-2.08x. Here both ranks' forward and backward run side by side, and the
    extra time falls while the other rank waits for the gradients' all-reduce. Registered inside
    the phase clock's ``plait_build_engine`` wrapper (``plugins/fault/phases.py``, the
    outermost), so these hooks run before the clock's: the extra time falls before the last
    gradient and inside the optimizer step, on both clocks."""

    def __init__(self, engine):
        self.params = [p for p in engine.model.parameters() if p.requires_grad]
        self.started, self.grads = 0.0, 0
        engine.model.register_forward_pre_hook(self._forward_start)
        for param in self.params:
            param.register_post_accumulate_grad_hook(self._grad_ready)
        engine.optimizer.register_step_pre_hook(self._start)
        engine.optimizer.register_step_post_hook(self._again)

    def _start(self, *hook_args) -> None:
        self.started = time.thread_time()

    def _again(self, *hook_args) -> None:
        busy(time.thread_time() - self.started)

    def _forward_start(self, module, args) -> None:
        if torch.is_grad_enabled():
            self._start()
            self.grads = 0

    def _grad_ready(self, param) -> None:
        self.grads += 1
        if self.grads == len(self.params):
            self._again()


class SlowRanks:
    """Global ranks ``ranks`` compute twice as long (``TwiceAsLong``). Registered on every rank;
    only those ranks change."""

    def __init__(self, ranks):
        self.ranks = set(ranks)

    @hookimpl(wrapper=True)
    def plait_build_engine(self, topology):
        engine = yield
        if topology.rank in self.ranks:
            TwiceAsLong(engine)
        return engine


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
    """Every rank of node ``node`` (``GROUP_RANK``) computes twice as long: a straggling node."""

    def __init__(self, node: int):
        self.node = node

    @hookimpl(wrapper=True)
    def plait_build_engine(self, topology):
        engine = yield
        if topology.node_rank == self.node:
            TwiceAsLong(engine)
        return engine


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
