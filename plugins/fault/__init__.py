"""The step guard of ``fault=checkpoint``: skip non-finite steps on every rank, roll back after
``fault.max_bad_steps`` in a row, flag loss spikes, and log the restart count.

A step is bad when the loss or the gradient norm is not finite on any rank. The engines ask
``plait_check_step`` between backward and the optimizer step; the answer is agreed by one
all-reduce over the trainer ranks, so the whole job skips the same step and nothing hangs. The
parameters and optimizer state stay as they were, bit for bit, and the step counter does not
advance; the batch is spent (the next step takes the next one). ``fault.max_bad_steps``
consecutive bad steps end the attempt with an error: the launcher's restart
(``launcher.max_restarts``) then resumes from the last complete checkpoint, which is the
rollback. Under fp16 the engines pass the loss alone: a gradient overflow is the loss scaler's
to skip (routine in the first steps), not a bad step.

Metrics of every logged step gain ``restarts`` (torch elastic's or SLURM's restart count, so
W&B shows it) and, with ``fault.spike_factor=F > 0``, ``loss_spike`` (1 when the loss exceeds F
times the median of the last logged losses; also printed).
"""

from __future__ import annotations

import math
import os
import statistics
import sys
from collections import deque

import torch
import torch.distributed as dist

from plait import hookimpl
from plait.config import AT_LEAST_1, Range, range_problems
from plait.types import PluginInfo

RANGES = {"max_bad_steps": AT_LEAST_1, "spike_factor": Range(0, meaning="0: off")}
SPIKE_WINDOW = 20  # logged losses the running median is taken over
SPIKE_MIN_HISTORY = 5  # no spike is flagged before this many logged losses


class BadStepsError(RuntimeError):
    """Too many consecutive non-finite steps: the attempt ends so a restart rolls back."""


def restart_count() -> int:
    return max(int(os.environ.get(v, 0)) for v in ("TORCHELASTIC_RESTART_COUNT",
                                                   "SLURM_RESTART_COUNT"))


class StepGuard:
    def __init__(self) -> None:
        self.bad_in_a_row = 0
        self.spike_factor = 0.0
        self.losses: deque[float] = deque(maxlen=SPIKE_WINDOW)

    @hookimpl
    def plait_declare(self) -> PluginInfo:
        return PluginInfo(name="step_guard", selected_by={"fault.name": "checkpoint"},
                          description="skip non-finite steps on every rank, roll back after "
                                      "fault.max_bad_steps, flag loss spikes, count restarts")

    @hookimpl
    def plait_validate(self, cfg) -> list[str]:
        return range_problems("fault", cfg.fault, RANGES)

    @hookimpl
    def plait_check_step(self, cfg, loss, grad_norm, topology) -> bool:
        bad = torch.tensor([0.0 if torch.isfinite(loss) else 1.0,
                            0.0 if torch.isfinite(grad_norm) else 1.0], device=loss.device)
        group = topology.trainer_group  # None: every rank trains
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=group)
        if not bad.any():
            self.bad_in_a_row = 0
            return False
        self.bad_in_a_row += 1
        what = " and ".join(n for n, b in zip(("loss", "gradient norm"), bad.tolist()) if b)
        if topology.rank == 0:
            print(f"plait: non-finite {what} on some rank: step skipped on every rank "
                  f"({self.bad_in_a_row} in a row)", file=sys.stderr, flush=True)
        if self.bad_in_a_row >= cfg.fault.max_bad_steps:
            raise BadStepsError(
                f"fault.max_bad_steps={cfg.fault.max_bad_steps} consecutive steps with a "
                f"non-finite {what}: ending this attempt so that a restart "
                "(launcher.max_restarts) resumes from the last complete checkpoint")
        return True

    @hookimpl
    def plait_on_run_start(self, cfg, state) -> None:
        self.spike_factor = cfg.fault.spike_factor
        if restart_count():
            print(f"plait: restart {restart_count()}: continuing at step {state.step}",
                  flush=True)

    @hookimpl(wrapper=True)
    def plait_log_metrics(self, step, metrics):
        """Adds ``restarts`` and ``loss_spike`` to the metrics before the trackers see them."""
        metrics["restarts"] = float(restart_count())
        loss = metrics.get("loss")
        if self.spike_factor > 0 and loss is not None and math.isfinite(loss):
            median = statistics.median(self.losses) if self.losses else math.nan
            spike = len(self.losses) >= SPIKE_MIN_HISTORY and loss > self.spike_factor * median
            metrics["loss_spike"] = float(spike)
            if spike:
                print(f"plait: loss spike at step {step}: {loss:.4g} > fault.spike_factor="
                      f"{self.spike_factor} x running median {median:.4g}", flush=True)
            self.losses.append(loss)
        return (yield)


plugin = StepGuard()
