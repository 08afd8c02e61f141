"""The step guard of ``fault=checkpoint``: skip non-finite steps and loss spikes on every rank,
roll back after ``fault.max_bad_steps`` in a row, and log the restart count.

A step is bad when the loss or the gradient norm is not finite on any rank, or, with
``fault.spike_factor=F > 0``, when a loss spikes: the highest rank's loss exceeds F times the
median of the last ``SPIKE_WINDOW`` steps taken (their highest rank losses; judged once
``SPIKE_MIN_HISTORY`` steps were taken). The engines ask ``plait_check_step`` between backward
and the optimizer step; the answer is agreed by one all-reduce over the trainer ranks (the
non-finite flags and the loss, by their maximum), so the whole job skips the same step and
nothing hangs. The parameters and optimizer state stay as they were, bit for bit, and the step
counter does not advance; the batch is spent (the next step takes the next one: PaLM's remedy
for a spike, without its rewind). ``fault.max_bad_steps`` consecutive bad steps end the attempt
with an error: the launcher's restart (``launcher.max_restarts``) then resumes from the last
complete checkpoint, which is the rollback (a loss that settles at a new level, spiking step
after step, ends there rather than skipping forever). Under fp16 the engines pass the loss alone:
a gradient overflow is the loss scaler's to skip (routine in the first steps), not a bad step.

Metrics of every logged step gain ``restarts`` (torch elastic's or SLURM's restart count, so
W&B shows it) and, with ``fault.spike_factor`` set, ``loss_spikes`` (the steps skipped as spikes
so far in this attempt).
"""

from __future__ import annotations

import os
import statistics
import sys
from collections import deque

import torch
import torch.distributed as dist

from plait import hookimpl
from plait.config import AT_LEAST_1, Range, range_problems
from plait.plugins.fault.config import GUARDED, FaultToleranceConfig
from plait.types import PluginInfo

RANGES = {"max_bad_steps": AT_LEAST_1, "spike_factor": Range(0, meaning="0: off")}
SPIKE_WINDOW = 20  # steps taken whose losses the running median is taken over
SPIKE_MIN_HISTORY = 5  # no spike is judged before this many steps were taken


class BadStepsError(RuntimeError):
    """Too many consecutive non-finite steps: the attempt ends so a restart rolls back."""


def restart_count() -> int:
    return max(
        int(os.environ.get(v, 0)) for v in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")
    )


class StepGuard:
    def __init__(self) -> None:
        self.bad_in_a_row = 0
        self.spikes = 0  # steps skipped as loss spikes
        self.taken: deque[float] = deque(maxlen=SPIKE_WINDOW)  # losses of the steps taken
        self.spike_factor = 0.0

    @hookimpl
    def plait_declare(self) -> PluginInfo:
        return PluginInfo(
            name="step_guard",
            selected_by={"fault.name": GUARDED},
            description="skip non-finite steps and loss spikes on every rank, roll "
            "back after fault.max_bad_steps, count restarts",
        )

    @hookimpl
    def plait_register_configs(self, config_store) -> None:
        """The fault plugins' schema (``config.py``), stored once, by this one of them."""
        config_store.store(group="fault", name="base_fault_tolerance", node=FaultToleranceConfig)

    @hookimpl
    def plait_validate(self, cfg) -> list[str]:
        return range_problems("fault", cfg.fault, RANGES)

    @hookimpl
    def plait_check_step(self, cfg, loss, grad_norm, topology) -> bool:
        # one MAX reduction: either flag on any rank, and the highest rank's loss; built on the
        # device, so that the step waits for its gradients once (at tolist), not at each figure
        loss = loss.detach().float().reshape(())
        finite = torch.isfinite(loss)
        figures = torch.stack(
            [
                (~finite).float(),
                (~torch.isfinite(grad_norm.detach().float().reshape(()))).float().to(loss.device),
                torch.where(finite, loss, torch.zeros_like(loss)),
            ]
        )
        group = topology.trainer_group  # None: every rank trains
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(figures, op=dist.ReduceOp.MAX, group=group)
        bad_loss, bad_norm, highest = figures.tolist()
        if bad_loss or bad_norm:
            what = "non-finite " + " and ".join(
                n for n, b in (("loss", bad_loss), ("gradient norm", bad_norm)) if b
            )
        elif spike := self._spike(highest, cfg.fault.spike_factor):
            what = spike
            self.spikes += 1
        else:
            self.bad_in_a_row = 0
            self.taken.append(highest)
            return False
        self.bad_in_a_row += 1
        if topology.rank == 0:
            print(
                f"plait: {what} on some rank: step skipped on every rank "
                f"({self.bad_in_a_row} in a row)",
                file=sys.stderr,
                flush=True,
            )
        if self.bad_in_a_row >= cfg.fault.max_bad_steps:
            raise BadStepsError(
                f"fault.max_bad_steps={cfg.fault.max_bad_steps} consecutive steps with a "
                f"{what}: ending this attempt so that a restart "
                "(launcher.max_restarts) resumes from the last complete checkpoint"
            )
        return True

    def _spike(self, loss: float, factor: float) -> str | None:
        """How ``loss`` spikes above the running median, or None."""
        if factor <= 0 or len(self.taken) < SPIKE_MIN_HISTORY:
            return None
        median = statistics.median(self.taken)
        if loss <= factor * median:
            return None
        return (
            f"loss spike ({loss:.4g} > fault.spike_factor={factor:g} x the median "
            f"{median:.4g} of the last {len(self.taken)} steps)"
        )

    @hookimpl
    def plait_on_run_start(self, cfg, state) -> None:
        self.spike_factor = cfg.fault.spike_factor
        if restart_count():
            print(f"plait: restart {restart_count()}: continuing at step {state.step}", flush=True)

    @hookimpl(wrapper=True)
    def plait_log_metrics(self, step, metrics):
        """Adds ``restarts`` and ``loss_spikes`` to the metrics before the trackers see them."""
        metrics["restarts"] = float(restart_count())
        if self.spike_factor > 0:
            metrics["loss_spikes"] = float(self.spikes)
        return (yield)


plugin = StepGuard()
