"""The straggler detector of ``fault=checkpoint``: name the rank whose compute holds the job back,
and with ``fault.straggler_action=exclude`` take its node out of an elastic job.

A rank's compute is ``compute_s``: its forward, backward compute and optimizer on the device's
own clock (``phases.py``: the wait in collectives is apart, so the victim of a slow peer is not
named; CPU time on a CPU, CUDA events on a GPU), as the core gathers it per rank on every logged
step. Over the last ``fault.straggler_window`` logged steps::

    ratio_r(k)   = compute_r(k) / median_{q != r} compute_q(k)        (logged step k)
    slowdown_r   = median_k ratio_r(k)                                 (over the window)

The first logged step of each run (or restart) is left out: it carries one-time costs (the
allocator's first blocks, DDP's bucket rebuild) that differ between ranks. The rank with the
largest slowdown is named when the window is full and its slowdown is at least
``fault.straggler_factor``: ``straggler/rank`` and ``straggler/slowdown`` join the step's metrics
(``metrics.jsonl``, W&B) and the console says so when a rank is first named or cleared. The
median over the others (not over everyone) makes a 2x rank read 2x also on two ranks; the
median over the window makes one noisy step name no one.

Under ``fault=torchft`` the ranks judged here are one replica group's, and ``exclude`` drops the
slow *group* from the quorum instead (``plait.plugins.fault.torchft.stragglers``).

``exclude`` (an elastic job, ``launcher.nnodes=MIN:MAX``): the logging rank's verdict is
broadcast to every trainer on logged steps; after the next checkpoint every rank of the
straggler's node leaves (``membership.leave_job``: its agent is stopped) and every other rank
ends its attempt (``NodeExcluded``), so torch elastic re-forms the group without that node and
it resumes from that checkpoint at fewer nodes, ``train.batch_size`` kept (docs/fault.md). Node
0 hosts the rendezvous and is never excluded, nor is a node of a group already at MIN nodes.
"""

from __future__ import annotations

import re
import statistics
import sys
from collections import deque

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from plait import hookimpl
from plait.config import AT_LEAST_1, Range, range_problems
from plait.plugins.fault.config import GUARDED
from plait.plugins.fault.membership import NodeExcluded, leave_job
from plait.types import PluginInfo

ACTIONS = ("warn", "exclude")
RANGES = {
    "straggler_factor": Range(1, low_open=True, meaning="or 0: off"),
    "straggler_window": AT_LEAST_1,
}
PER_RANK = re.compile(r"^compute_s/rank(\d+)$")


def compute_by_rank(metrics: dict[str, float]) -> dict[int, float]:
    """Each rank's compute seconds (``compute_s/rank<r>``: on the device's own clock) of a
    logged step."""
    return {int(m.group(1)): value for key, value in metrics.items() if (m := PER_RANK.match(key))}


def slowdowns(window: list[dict[int, float]]) -> dict[int, float]:
    """Each rank's median, over the window, of its compute over the median of the others'."""
    ratios: dict[int, list[float]] = {}
    for compute in window:
        for rank, seconds in compute.items():
            others = [s for r, s in compute.items() if r != rank]
            if others and statistics.median(others) > 0:
                ratios.setdefault(rank, []).append(seconds / statistics.median(others))
    return {rank: statistics.median(r) for rank, r in ratios.items()}


class StragglerDetector:
    def __init__(self) -> None:
        self.window: deque[dict[int, float]] = deque()
        self.factor = 0.0
        self.node_of: list[int] = []
        self.named: tuple[int, float] | None = None  # (rank, slowdown) while one is named
        self.pending: tuple[int, float] | None = None  # agreed for exclusion, on every rank
        self.warmed_up = False  # the first logged step of a run is left out (one-time costs)

    @hookimpl
    def plait_declare(self) -> PluginInfo:
        return PluginInfo(
            name="straggler",
            selected_by={"fault.name": GUARDED},
            description="name the rank whose compute holds the job back "
            "(fault.straggler_factor); warn, or exclude its node",
        )

    @hookimpl
    def plait_validate(self, cfg, dims) -> list[str]:
        fault = cfg.fault
        problems = range_problems("fault", fault, RANGES)
        if fault.straggler_factor == 0:  # 0 is off, not out of range
            problems = [p for p in problems if not p.startswith("fault.straggler_factor=")]
        if fault.straggler_action not in ACTIONS:
            problems.append(
                f"fault.straggler_action={fault.straggler_action}: choose warn or exclude"
            )
        elif fault.straggler_action == "exclude" and fault.name == "torchft":
            pass  # the slow replica group leaves the quorum (plait.plugins.fault.torchft)
        elif fault.straggler_action == "exclude":
            if not dims.elastic:
                problems.append(
                    f"fault.straggler_action=exclude takes the straggler's node out of an "
                    f"elastic job, but launcher.nnodes={cfg.launcher.nnodes} is fixed: give a "
                    "range (e.g. launcher.nnodes=1:2), or set fault.straggler_action=warn"
                )
            # the exclusion happens at a periodic checkpoint: the checkpoint group's setting
            # (None where another plugin than the checkpoint plugin is selected for it)
            every = OmegaConf.select(cfg, "checkpoint.every", default=None)
            if every == 0:
                problems.append(
                    "fault.straggler_action=exclude re-forms the group from the "
                    "checkpoint after the verdict, but checkpoint.every=0 "
                    "writes one only at the end: set checkpoint.every=N"
                )
            if fault.straggler_factor == 0:
                problems.append(
                    "fault.straggler_action=exclude with fault.straggler_factor=0 "
                    "(the detector off): set fault.straggler_factor > 1"
                )
        return problems

    @hookimpl
    def plait_on_run_start(self, cfg, topology) -> None:
        self.factor = cfg.fault.straggler_factor
        self.window = deque(maxlen=cfg.fault.straggler_window)
        self.node_of = topology.node_of

    @hookimpl(wrapper=True)
    def plait_log_metrics(self, step, metrics):
        """On the logging rank: the verdict joins the step's metrics before trackers see it."""
        compute = compute_by_rank(metrics)
        if self.factor > 0 and len(compute) > 1:
            if self.warmed_up:
                self.window.append(compute)
                self._judge(step, metrics)
            self.warmed_up = True
        return (yield)

    def _judge(self, step: int, metrics: dict[str, float]) -> None:
        named = None
        found = slowdowns(list(self.window)) if len(self.window) == self.window.maxlen else {}
        if found:
            rank, slowdown = max(found.items(), key=lambda kv: kv[1])
            if slowdown >= self.factor:
                named = (rank, slowdown)
        if named is not None:
            metrics["straggler/rank"], metrics["straggler/slowdown"] = float(named[0]), named[1]
            if self.named is None or self.named[0] != named[0]:
                print(
                    f"plait: straggler at step {step}: rank {named[0]} (node "
                    f"{self.node_of[named[0]]}) computes {named[1]:.2f}x the median of the "
                    f"other ranks over the last {len(self.window)} logged steps "
                    f"(fault.straggler_factor={self.factor})",
                    file=sys.stderr,
                    flush=True,
                )
        elif self.named is not None:
            print(
                f"plait: straggler at step {step}: rank {self.named[0]} is no longer named",
                file=sys.stderr,
                flush=True,
            )
        self.named = named

    @hookimpl(wrapper=True)
    def plait_save_checkpoint(self, cfg, state, topology, final):
        """On every rank, with ``exclude``: agree on the verdict on logged steps; after the
        next checkpoint the straggler's node leaves and the others re-form without it."""
        written = yield
        # under fault=torchft the slow replica group leaves the quorum instead (torchft plugin)
        if cfg.fault.straggler_action != "exclude" or final or cfg.fault.name == "torchft":
            return written
        if state.step % cfg.train.log_every == 0:
            self.pending = self._agree(topology)
        if self.pending is not None and written is not None:
            self._exclude(cfg, topology, written)
        return written

    def _agree(self, topology) -> tuple[int, float] | None:
        """The logging rank's verdict on every trainer (one small broadcast)."""
        verdict = torch.tensor(
            self.named if self.named else (-1.0, 0.0), dtype=torch.float64, device=topology.device
        )
        dist.broadcast(verdict, src=topology.trainer_ranks[0], group=topology.trainer_group)
        rank, slowdown = verdict.tolist()
        return (int(rank), slowdown) if rank >= 0 else None

    def _exclude(self, cfg, topology, written) -> None:
        rank, slowdown = self.pending
        node = topology.node_of[rank]
        why = (
            f"rank {rank} computes {slowdown:.2f}x the median of the others "
            f"(fault.straggler_factor={cfg.fault.straggler_factor})"
        )
        smallest = topology.dims.nodes.min
        if node == 0 or topology.dims.nnodes <= smallest:
            if topology.is_logging_rank:
                print(
                    f"plait: straggler: {why}, but node {node} "
                    + (
                        "hosts the rendezvous (node 0 cannot leave)"
                        if node == 0
                        else f"is one of the {smallest} node(s) launcher.nnodes="
                        f"{cfg.launcher.nnodes} needs"
                    )
                    + ": not excluded",
                    file=sys.stderr,
                    flush=True,
                )
            self.pending = None
            return
        message = (
            f"plait: excluding node {node} (fault.straggler_action=exclude): {why}; the "
            f"group re-forms without it from checkpoint {written.name}"
        )
        if topology.node_rank == node:
            leave_job(message, first_on_node=topology.local_rank == 0)
        raise NodeExcluded(message)


plugin = StragglerDetector()
