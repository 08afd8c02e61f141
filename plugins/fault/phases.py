"""Each rank's step split into forward, backward compute, optimizer and the wait in collectives,
measured apart so that a rank waiting for a slow peer is not taken for the slow one.

Why apart: DDP's all-reduce makes every rank's backward last as long as the slowest rank's
(traceml#252), so a detector that times ``backward()`` sees every rank equally slow, and one that
times the step sees the victim of a slow peer as slow as the peer. The phases, on the wall clock:

    forward_s    the model's forward pre-hook to its forward hook, per micro-batch
    backward_s   the end of that forward to the last gradient accumulated into a parameter
                 (a post-accumulate-grad hook on every parameter): the backward's compute.
                 DDP waits for its bucket all-reduces after the last gradient (its reducer's
                 finalize, the autograd engine's final callback), so that wait is not in here
    optimizer_s  ``optimizer.step`` (the optimizer's step pre- and post-hooks)
    comm_wait_s  the rest of the engine's step: waiting in collectives (the gradient
                 all-reduce that backward did not hide, the loss, guard and norm reductions)
                 and the engine's bookkeeping

and ``compute_s``, the same three compute intervals on the device's own clock, which the
straggler detector judges: on a GPU the time between CUDA events recorded at those points (the
GPU's time, as Megatron's ``StragglerDetector`` takes it; the wall clock there sees only the
host queueing kernels), on a CPU the CPU time of the rank's thread (``time.thread_time``). Not
the wall clock on a CPU: where processes share cores, the scheduler favours a process that
slept, so the rank that waited in a collective gets the core and the rank that computes is
descheduled; its compute phases then take longer on the wall clock than its work (seen on a
loaded 2-core host: a rank of a plain run read 4x for 40 steps). The CPU time counts the work.

Only logged steps are timed (every ``train.log_every``-th and the last): the core's
``StepMeter`` gathers the figures per rank on those steps alone (``StepOutput.timings``, beside
its ``data_wait_s``), so timing the others would cost every step for figures no one reads. On
other steps the hooks only keep the watchdog's progress marks, where the watchdog is on. Where an engine reduces inside backward on the main thread (DeepSpeed
ZeRO-2/3's gradient hooks, FSDP's reduce-scatter) or gathers parameters inside forward (ZeRO-3,
FSDP), those waits fall in ``backward_s`` / ``forward_s`` (on the wall clock; a blocking wait
costs no CPU time); under a pipeline (``parallel.pp>1``) the schedule calls the stages' parts,
not the model, so only ``optimizer_s`` and ``comm_wait_s`` are split (docs/report.md).

The same hooks mark each rank's progress (step, micro-batch, phase, gradients so far) for the
collective watchdog (``watchdog.py``), which names the rank that did not arrive.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Callable

import torch

from plait import hookimpl
from plait.config import job_last_step
from plait.plugins.fault.config import GUARDED
from plait.types import PluginInfo

PHASES = ("before forward", "forward", "backward", "optimizer", "after the step")


@dataclass
class Progress:
    """Where this rank's main thread is; the watchdog publishes it as the rank's heartbeat.

    ``position`` orders ranks of one job: a rank whose position is lower than another's has not
    reached the point the other waits at."""

    step: int = 0  # the step being taken (the resumed step + 1 at the first one)
    micro_batch: int = 0  # forwards started in this step
    phase: int = len(PHASES) - 1
    grads: int = 0  # gradients accumulated since the last forward
    total_grads: int = 1
    changed_at: float = 0.0  # time.monotonic() of the last change
    compute_s: float | None = None  # the last step's compute (None: not measured, a pipeline)

    def mark(self, phase: int) -> None:
        self.phase, self.changed_at = phase, time.monotonic()

    @property
    def position(self) -> tuple[int, int, int, float]:
        return (self.step, self.micro_batch, self.phase, self.grads / self.total_grads)

    def describe(self) -> str:
        if self.micro_batch == 0 and self.phase == len(PHASES) - 1:
            return f"start-up or between steps, before step {self.step + 1}"
        where = PHASES[self.phase]
        if self.phase == 2:
            where += f" ({self.grads} of {self.total_grads} gradients)"
        return f"step {self.step}, micro-batch {self.micro_batch}: {where}"


progress = Progress(changed_at=time.monotonic())


def torch_optimizer(optimizer) -> torch.optim.Optimizer | None:
    """The torch optimizer that steps: the engine's, or the one a wrapper holds (DeepSpeed's
    ZeRO optimizer as ``.optimizer``; torch's ``PostLocalSGDOptimizer``, an ``Optimizer``
    that skips ``Optimizer.__init__`` and so has no step hooks, as ``.optim``)."""
    for _ in range(4):
        if isinstance(optimizer, torch.optim.Optimizer) and hasattr(
            optimizer, "_optimizer_step_pre_hooks"
        ):
            return optimizer
        optimizer = getattr(optimizer, "optimizer", None) or getattr(optimizer, "optim", None)
    return None


class CpuWork:
    """The rank's thread's CPU time: its work, however the host shares its cores. The
    backward's end is read once, when the step goes on after it (``at_backward_end``), not at
    every gradient: a wait in between costs no CPU time, and reading the thread's CPU clock at
    each of a GPT's gradients cost ~3% of a CPU step (py-spy, issue 32)."""

    at_backward_end = True

    def stamp(self) -> float:
        return time.thread_time()

    def stamp_again(self, stamp) -> float:
        return time.thread_time()

    def seconds(self, start, end) -> float:
        return end - start


class CudaWork:
    """CUDA events on the current stream: the GPU's time between two points of the host's
    program (one event object per point; the last-gradient point is re-recorded)."""

    at_backward_end = False  # the stream goes on into the gradients' all-reduce wait

    def stamp(self):
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def stamp_again(self, stamp):
        stamp.record()
        return stamp

    def seconds(self, start, end) -> float:
        end.synchronize()
        return start.elapsed_time(end) / 1e3


class PhaseClock:
    """Hooks on one engine's model and optimizer that time the phases of its ``train_step``.

    Only the steps ``timed(step)`` says (the logged steps, whose figures the core gathers) are
    timed; on the others the hooks keep the watchdog's progress marks where ``marks`` (the
    watchdog is on) and do nothing else. The model's forward hooks run outside
    ``torch.compile``'s graphs (``torch.compiler.disable``): traced, a CUDA event would be made
    and never recorded, and a CPU clock read once at compile time."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer,
        device: torch.device,
        timed: Callable[[int], bool] = lambda step: True,
        marks: bool = True,
    ) -> None:
        self.work = CudaWork() if device.type == "cuda" else CpuWork()
        self.timed, self.marks = timed, marks
        self.inside = False  # only train_step's passes count (not evaluation)
        self.timing = False  # this step is timed
        self.forwards = 0
        self.sums = dict.fromkeys(("forward_s", "backward_s", "optimizer_s"), 0.0)
        self.intervals: list = []  # (start, end) stamps of the work clock
        self._forward_started = self._forward_ended = self._optimizer_started = 0.0
        self._work_started = self._work_forward_ended = None
        self._last_grad: float | None = None
        self._work_last_grad = None
        params = [p for p in model.parameters() if p.requires_grad]
        progress.total_grads = max(len(params), 1)
        model.register_forward_pre_hook(torch.compiler.disable(self._forward_start))
        model.register_forward_hook(torch.compiler.disable(self._forward_end))
        for param in params:
            param.register_post_accumulate_grad_hook(self._grad_ready)
        stepping = torch_optimizer(optimizer)
        if stepping is not None:
            stepping.register_step_pre_hook(self._optimizer_start)
            stepping.register_step_post_hook(self._optimizer_end)

    def train_step(self, inner, micro_batches, lr):
        """``inner(micro_batches, lr=lr)``; on a timed step with its phases in
        ``StepOutput.timings``."""
        progress.step += 1
        progress.micro_batch = 0
        progress.mark(0)
        self.timing = self.timed(progress.step)
        if not (self.timing or self.marks):
            out = inner(micro_batches, lr=lr)
        else:
            out = self._observed(inner, micro_batches, lr)
        progress.mark(len(PHASES) - 1)
        if out.skipped:  # the loop does not count a skipped step
            progress.step -= 1
        return out

    def _observed(self, inner, micro_batches, lr):
        self.sums = dict.fromkeys(self.sums, 0.0)
        self.intervals = []
        self.forwards = 0
        self._last_grad = None
        self.inside = True
        started = time.perf_counter()
        try:
            out = inner(micro_batches, lr=lr)
        finally:
            self.inside = False
        total = time.perf_counter() - started
        self._close_backward()
        if not self.timing:
            return out
        compute = sum(self.sums.values())
        out.timings.update(self.sums, comm_wait_s=max(total - compute, 0.0))
        if self.forwards:  # a pipeline's schedule calls the stages' parts: no compute to judge
            out.timings["compute_s"] = sum(self.work.seconds(a, b) for a, b in self.intervals)
        progress.compute_s = out.timings.get("compute_s")
        return out

    def _close_backward(self) -> None:
        """Count the backward since the last forward; none where no forward was seen (a
        pipeline's schedule: its gradients arrive with no forward end to measure from)."""
        if self._last_grad is not None and self.forwards:
            if self.work.at_backward_end:
                self._work_last_grad = self.work.stamp()
            self.sums["backward_s"] += self._last_grad - self._forward_ended
            self.intervals.append((self._work_forward_ended, self._work_last_grad))
        self._last_grad = self._work_last_grad = None

    def _forward_start(self, module, args) -> None:
        if self.inside and torch.is_grad_enabled():
            self._close_backward()
            progress.micro_batch += 1
            self.forwards += 1
            progress.grads = 0
            progress.mark(1)
            if self.timing:
                self._work_started = self.work.stamp()
                self._forward_started = time.perf_counter()

    def _forward_end(self, module, args, output) -> None:
        if self.inside and torch.is_grad_enabled():
            if self.timing:
                self._forward_ended = time.perf_counter()
                self._work_forward_ended = self.work.stamp()
                self.sums["forward_s"] += self._forward_ended - self._forward_started
                self.intervals.append((self._work_started, self._work_forward_ended))
            progress.mark(2)

    def _grad_ready(self, param) -> None:
        if self.inside:
            if self.timing:
                self._last_grad = time.perf_counter()
                if not self.work.at_backward_end:
                    self._work_last_grad = (
                        self.work.stamp()
                        if self._work_last_grad is None
                        else self.work.stamp_again(self._work_last_grad)
                    )
            progress.grads += 1
            progress.changed_at = time.monotonic()

    def _optimizer_start(self, optimizer, args, kwargs) -> None:
        if self.inside:
            self._close_backward()
            progress.mark(3)
            if self.timing:
                self._work_started = self.work.stamp()
                self._optimizer_started = time.perf_counter()

    def _optimizer_end(self, optimizer, args, kwargs) -> None:
        if self.inside:
            if self.timing:
                self.sums["optimizer_s"] += time.perf_counter() - self._optimizer_started
                self.intervals.append((self._work_started, self.work.stamp()))
            progress.mark(4)


def logged_steps(cfg) -> Callable[[int], bool]:
    """Whether a step is logged: every ``train.log_every``-th and the job's last."""
    every, last = cfg.train.log_every, job_last_step(cfg.train)
    return lambda step: step % every == 0 or step == last


def timing_wanted(cfg) -> bool:
    """The straggler detector reads the phases, the watchdog the progress marks."""
    return cfg.fault.straggler_factor > 0 or cfg.fault.collective_timeout_s is not None


class StepTiming:
    @hookimpl
    def plait_declare(self) -> PluginInfo:
        return PluginInfo(
            name="step_timing",
            selected_by={"fault.name": GUARDED},
            description="per-rank forward, backward compute, optimizer and "
            "collective-wait times of every step",
        )

    # outermost: the phases of the whole step, whatever other wrappers add
    @hookimpl(wrapper=True, tryfirst=True)
    def plait_build_engine(self, cfg, topology):
        engine = yield
        if timing_wanted(cfg):
            clock = PhaseClock(
                engine.model,
                getattr(engine, "optimizer", None),
                topology.device,
                timed=logged_steps(cfg) if cfg.fault.straggler_factor > 0 else lambda step: False,
                marks=cfg.fault.collective_timeout_s is not None,
            )
            engine.train_step = functools.partial(clock.train_step, engine.train_step)
        return engine

    @hookimpl(wrapper=True)
    def plait_load_checkpoint(self):
        state = yield
        progress.step = state.step if state is not None else 0
        return state

    @hookimpl(wrapper=True)
    def plait_sync_replicas(self):
        """A replica group that received a peer's state (``fault=torchft``) continues at the
        peer's step, so it times the same logged steps as the others: the straggler detector's
        exchange after them is a collective every group of the quorum must join (one that did
        not, after a restart, stalled both sides until the 60 s timeouts)."""
        received = yield
        if received is not None:
            progress.step = received.step
        return received


plugin = StepTiming()
