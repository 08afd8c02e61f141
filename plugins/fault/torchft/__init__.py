"""``fault=torchft``: per-step fault tolerance on torchft (PyTorch's fault-tolerance library).

    plait train strategy=ddp parallel.tp=2 launcher.nproc_per_node=4 fault=torchft \\
        launcher.max_restarts=3 fault.min_replicas=1 checkpoint.every=100

The strategy's replica groups (``plait_replica_groups``: each dp rank under ``strategy=ddp``,
each replicate group of HSDP under ``strategy=fsdp strategy.replicate=N``; inside a group tp,
pp, cp and ep stay as they are) run as independent torch jobs, each started and restarted by
an agent of its own (``launcher.max_restarts``, ``plait.plugins.launch.replica_groups``). Each
step torchft's lighthouse forms a quorum of the groups alive; their gradients are averaged over
it and the step is committed by torchft's manager (``replicas.py``). A group that dies is left
out of the next quorum and the others go on stepping; when its agent has restarted it, it
joins a quorum, receives a healthy peer's state over the network (no checkpoint read) and takes
part in that very step. plait's periodic checkpoints (``checkpoint.*``) are written by the first
group of each step's quorum and cover the loss of every group at once.

What was taken from torchft: the lighthouse and its quorum, the ``Manager`` (quorum, process
group reconfiguration, fault-tolerant all-reduce, commit, live recovery over its HTTP
transport), its reconfigurable gloo/NCCL process groups. What plait wrote: the replica groups
as separate agents, the state a recovering group receives (the engine's own state by rank, the
train state, the random generators), the first quorum before the checkpoint is read, the
writer of the checkpoints, the metrics and refusals. See docs/fault.md.
"""

from __future__ import annotations

import importlib.util
import os

from plait import hookimpl
from plait.config import AT_LEAST_1, POSITIVE, Range, range_problems
from plait.plugin_manager import offered_by
from plait.plugins.fault.config import TorchftConfig
from plait.plugins.fault.torchft.lighthouse import LIGHTHOUSE_ENV, lighthouse, not_answering
from plait.types import PluginInfo

REPLICA_GROUPS = "engine:replica_groups"
RANGES = {
    "min_replicas": AT_LEAST_1,
    "join_timeout_ms": Range(0),
    "quorum_tick_ms": AT_LEAST_1,
    "heartbeat_timeout_ms": AT_LEAST_1,
    "manager_timeout_s": POSITIVE,
    "quorum_timeout_s": POSITIVE,
    "lighthouse_port": Range(0, 65535, meaning="0: chosen, docs/fault.md"),
}


class Torchft:
    def __init__(self) -> None:
        self.groups = None  # this rank's replicas.ReplicaGroups, in a worker of a replica group

    @hookimpl
    def plait_declare(self) -> PluginInfo:
        return PluginInfo(
            name="torchft",
            selected_by={"fault.name": "torchft"},
            provides=frozenset({"fault:replica_groups"}),
            description="per-step fault tolerance on torchft: replica groups as jobs of their "
            "own, a quorum per step, live recovery from a peer",
        )

    @hookimpl
    def plait_register_configs(self, config_store) -> None:
        config_store.store(group="fault", name="base_torchft", node=TorchftConfig)

    @hookimpl
    def plait_validate(self, cfg, dims, hook) -> list[str]:
        fault = cfg.fault
        problems = range_problems("fault", fault, RANGES)
        if importlib.util.find_spec("torchft") is None:
            problems.append(
                "fault=torchft needs the torchft package, which is not installed: "
                "pip install 'plait[torchft]' (torchft>=0.2), or choose fault=checkpoint"
            )
        groups = hook.plait_replica_groups(cfg=cfg, dims=dims)
        if groups is None:
            problems.append(
                f"fault=torchft: strategy={cfg.strategy.name} cannot take part: its data-"
                "parallel ranks do not form replica groups of whole model replicas that step "
                "together and average their gradients (it shares optimizer or parameter "
                "state across them, or its replicas step at their own pace), so a group could "
                f"not leave and rejoin a step; use {offered_by(REPLICA_GROUPS)}, or "
                "fault=checkpoint"
            )
        elif groups < fault.min_replicas:
            problems.append(
                f"fault.min_replicas={fault.min_replicas}, but strategy={cfg.strategy.name} "
                f"forms {groups} replica group(s) here (dp={dims.dp}): no quorum could ever "
                f"form; set fault.min_replicas <= {groups}, or give data parallelism more ranks"
            )
        if dims.elastic:
            problems.append(
                f"fault=torchft with launcher.nnodes={cfg.launcher.nnodes}: replica groups "
                "leave and rejoin each step's quorum instead of the job changing size; give a "
                "fixed launcher.nnodes"
            )
        if fault.lighthouse:
            silent = not_answering(fault.lighthouse)
            if silent:
                problems.append(
                    f"fault.lighthouse={fault.lighthouse} does not answer: {silent}; start "
                    "torchft_lighthouse there first, or leave fault.lighthouse unset and "
                    "plait starts one on node 0"
                )
        return problems

    @hookimpl
    def plait_backend_config(self, cfg, dims, hook) -> dict:
        groups = hook.plait_replica_groups(cfg=cfg, dims=dims)
        if not groups:
            return {}
        fault = cfg.fault
        return {
            "torchft (fault=torchft)": {
                "replica groups": groups,
                "processes per group": dims.world_size // groups,
                "lighthouse": fault.lighthouse
                or "started by plait on node 0 (task 0 of a SLURM job)",
                "min_replicas": fault.min_replicas,
                "join_timeout_ms": fault.join_timeout_ms,
                "quorum_tick_ms": fault.quorum_tick_ms,
                "heartbeat_timeout_ms": fault.heartbeat_timeout_ms,
            }
        }

    @hookimpl(wrapper=True)
    def plait_launch(self, cfg):
        """The lighthouse runs for the whole launch; every worker finds it (torchft's
        ``TORCHFT_LIGHTHOUSE``)."""
        with lighthouse(cfg) as address:
            os.environ[LIGHTHOUSE_ENV] = address
            try:
                return (yield)
            finally:
                os.environ.pop(LIGHTHOUSE_ENV, None)

    # outside the pipeline's wrapper: the engine the loop steps is the one that averages
    @hookimpl(wrapper=True, tryfirst=True)
    def plait_build_engine(self, cfg, topology):
        engine = yield
        if topology.dims.replica_groups > 1:
            from plait.plugins.fault.torchft.replicas import ReplicaGroups

            self.groups = ReplicaGroups(cfg, engine, topology)
            engine.replicas = self.groups
        return engine

    @hookimpl
    def plait_sync_replicas(self, state, topology):
        if self.groups is None:
            return None
        received = self.groups.sync(state)
        topology.quorum_rank = self.groups.quorum_rank
        return received

    @hookimpl(wrapper=True)
    def plait_load_checkpoint(self):
        state = yield
        if self.groups is not None and state is not None:
            self.groups.loaded(state)
        return state

    @hookimpl(wrapper=True)
    def plait_log_metrics(self, metrics):
        """The step's quorum joins the metrics before the trackers see them."""
        if self.groups is not None:
            metrics.update(self.groups.metrics())
        return (yield)


plugin = Torchft()
