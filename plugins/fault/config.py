"""The fault plugins' settings: ``fault=checkpoint`` (fault tolerance by restarting from the last
checkpoint, with the guards below), stored as ``fault/base_fault_tolerance`` by the step guard
(``plait.plugins.fault``). Where checkpoints are written and how often is the checkpoint
plugin's (``checkpoint.*``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from plait.config import FaultConfig


@dataclass
class FaultToleranceConfig(FaultConfig):
    name: str = "checkpoint"
    # The step guard (plait.plugins.fault):
    max_bad_steps: int = 3  # consecutive skipped (non-finite, spiked) steps ending the attempt
    spike_factor: float = 0.0  # skip a step whose loss is above this x the running median; 0: off
    # The straggler detector and the collective watchdog (plait.plugins.fault, docs/fault.md):
    # name a rank whose compute time is this x the median of the others' over the window of
    # logged steps (0: off, with the per-rank phase timing); warn, or exclude its node
    straggler_factor: float = 1.5
    straggler_window: int = 5
    straggler_action: str = "warn"  # warn | exclude (an elastic job: launcher.nnodes=MIN:MAX)
    # every process group's timeout, and a heartbeat that names the rank that did not arrive
    collective_timeout_s: Optional[float] = None  # None: off
