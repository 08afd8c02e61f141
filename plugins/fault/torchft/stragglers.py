"""The straggler detector over replica groups (``fault=torchft`` with ``fault.straggler_factor``):
name the group whose compute holds every step back, and with ``fault.straggler_action=exclude``
drop it from the quorum instead of restarting the job.

A group's compute on a logged step is the largest ``compute_s`` of its ranks (the step waits for
its slowest rank; ``plait.plugins.fault.phases``, the device's own clock, the wait in
collectives apart). Every rank of every group in the last step's quorum exchanges it once per
logged step, at the top of the next step (one all-reduce over the groups of a vector with a slot
per group, on torchft's process group; a max over the group's ranks first), so every rank judges
the same numbers: over the last ``fault.straggler_window`` logged steps (the first left out)::

    ratio_g(k)  = compute_g(k) / median_{h != g} compute_h(k)
    slowdown_g  = median_k ratio_g(k)

(``plait.plugins.fault.straggler.slowdowns``, the rank detector's formula, over groups). The
group with the largest slowdown is named when it is at least ``fault.straggler_factor``
(``straggler/group``, ``straggler/slowdown`` in the metrics, a line on the console). With
``exclude`` the named group leaves before the next quorum: its ranks shut their torchft manager
down and end with exit code 0, so its agent does not restart it; the other groups' next quorum
forms without it (once the lighthouse's ``fault.heartbeat_timeout_ms`` has passed), and they go
on stepping. Never below ``fault.min_replicas`` groups (the verdict is then a warning).
"""

from __future__ import annotations

import sys
from collections import deque

import torch
import torch.distributed as dist

from plait.plugins.fault.phases import progress
from plait.plugins.fault.straggler import slowdowns


class ReplicaGroupLeaves(SystemExit):
    """This replica group leaves the job (excluded as a straggler): its ranks end with exit
    code 0, which its agent takes as the group's end, not as a failure to restart."""

    def __init__(self, message: str):
        super().__init__(0)
        self.message = message


class GroupStragglers:
    """Judges the replica groups of the last step's quorum on logged steps."""

    def __init__(self, cfg, groups: int, group: int, device: torch.device):
        fault = cfg.fault
        self.factor, self.exclude = fault.straggler_factor, fault.straggler_action == "exclude"
        self.min_replicas, self.groups, self.group = fault.min_replicas, groups, group
        self.log_every, self.device = cfg.train.log_every, device
        self.window: deque[dict[int, float]] = deque(maxlen=fault.straggler_window)
        self.warmed_up = False
        self.named: tuple[int, float] | None = None

    def judge(self, manager, step: int, logging: bool) -> tuple[int, float] | None:
        """After logged step ``step`` (before the next quorum, on every rank): exchange the
        groups' compute, judge, and with ``exclude`` make the named group leave. Not after a
        step whose collectives failed (torchft's manager then does not reduce)."""
        if self.factor <= 0 or step == 0 or step % self.log_every or progress.compute_s is None:
            return None
        if manager.errored() is not None:
            return self.named
        compute = self._exchange(manager)
        if not self.warmed_up:  # the first logged step carries one-time costs
            self.warmed_up = True
            return None
        self.window.append(compute)
        found = slowdowns(list(self.window)) if len(self.window) == self.window.maxlen else {}
        named = None
        if found:
            group, slowdown = max(found.items(), key=lambda kv: kv[1])
            if slowdown >= self.factor and len(compute) > 1:
                named = (group, slowdown)
        newly = named is not None and (self.named is None or self.named[0] != named[0])
        if logging and newly and named[0] == self.group:  # said once, by the group named
            print(
                f"plait: straggler at step {step}: replica group {named[0]} computes "
                f"{named[1]:.2f}x the median of the other groups over the last "
                f"{len(self.window)} logged steps (fault.straggler_factor={self.factor})",
                file=sys.stderr,
                flush=True,
            )
        self.named = named
        if named is not None and self.exclude and named[0] == self.group:
            if len(compute) - 1 >= self.min_replicas:
                raise ReplicaGroupLeaves(
                    f"plait: replica group {self.group} leaves the quorum "
                    f"(fault.straggler_action=exclude): it computes {named[1]:.2f}x the median "
                    f"of the other groups; they go on without it"
                )
        return named

    def _exchange(self, manager) -> dict[int, float]:
        """Each group's compute of the last logged step, by group, for the groups of the last
        quorum (a group outside it contributes nothing and is left out)."""
        mine = torch.tensor([progress.compute_s], dtype=torch.float64, device=self.device)
        if dist.get_world_size() > 1:  # the group waits for its slowest rank
            dist.all_reduce(mine, op=dist.ReduceOp.MAX)
        slots = torch.zeros(self.groups, dtype=torch.float64, device=self.device)
        slots[self.group] = mine
        manager.allreduce(slots).wait()  # the average over the participants
        slots *= manager.num_participants()
        return {group: float(v) for group, v in enumerate(slots.tolist()) if v > 0}
