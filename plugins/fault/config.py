"""The fault plugins' settings: ``fault=checkpoint`` (fault tolerance by restarting from the last
checkpoint, with the guards below), stored as ``fault/base_fault_tolerance`` by the step guard
(``plait.plugins.fault``), and ``fault=torchft`` (per-step fault tolerance over replica groups,
the same guards beside it), stored as ``fault/base_torchft`` by ``plait.plugins.fault.torchft``.
Where checkpoints are written and how often is the checkpoint plugin's (``checkpoint.*``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from plait.config import FaultConfig

# The fault options the step guard, the step timing, the straggler detector and the collective
# watchdog run under (their settings are in both options' schemas).
GUARDED = ("checkpoint", "torchft")


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


@dataclass
class TorchftConfig(FaultToleranceConfig):
    """``fault=torchft``: the strategy's replica groups run as independent torch jobs that
    average their gradients each step over the groups torchft's lighthouse admits to the
    step's quorum; a restarted group recovers from a live peer (docs/fault.md)."""

    name: str = "torchft"
    # A lighthouse you run (http://host:port); None: plait starts one on node 0
    lighthouse: Optional[str] = None
    # of the one plait starts; 0: a free port on one node, launcher.master_port + 1 on several
    # (under launcher=slurm the job's port + 1)
    lighthouse_port: int = 0
    # The lighthouse's quorum settings, named as torchft_lighthouse's flags
    min_replicas: int = 1  # groups a quorum needs (and a step, to be taken)
    join_timeout_ms: int = 60000  # how long a quorum waits for healthy groups still to join
    quorum_tick_ms: int = 100  # how often the lighthouse checks for a quorum while waiting
    heartbeat_timeout_ms: int = 5000  # a group silent this long is dead to the quorum
    # torchft.Manager's timeout (collectives across groups, commits, the live recovery) and
    manager_timeout_s: float = 60.0
    quorum_timeout_s: float = 60.0
