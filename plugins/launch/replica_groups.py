"""Replica groups that run as independent torch jobs (``fault=torchft``): each of this node's
groups gets an agent of its own, a rendezvous of its own and ``launcher.max_restarts`` restarts of
its own, so a group whose worker dies is restarted alone while the others go on.

A plugin that declares ``fault:replica_groups`` asks for it; the strategy says how many groups
its data-parallel ranks form (``plait_replica_groups``). Groups lie within a node: node ``k``
runs groups ``k * G .. (k + 1) * G - 1`` of ``G = launcher.nproc_per_node / group size``, each
on its own ``localhost`` rendezvous (torchrun ``--standalone``). Each group's workers learn
their group from ``PLAIT_REPLICA_GROUP`` (``plait.topology.replica_group_env``) and, on GPUs,
see only their group's devices (``CUDA_VISIBLE_DEVICES``, as torchft's and torchtitan's examples
give each group its own).

The agents run in threads of this process (torch elastic registers no signal handlers off the
main thread): they share the launcher's forkserver, and a group whose agent runs out of restarts
ends alone. This process stops them all on SIGTERM or SIGINT.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import uuid
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from plait.topology import REPLICA_GROUP_ENV

FAULT_REPLICA_GROUPS = "fault:replica_groups"  # a plugin runs the replica groups as jobs


def replica_groups(cfg, dims, hook) -> int:
    """How many independent torch jobs the ranks run as: the strategy's replica groups where an
    active plugin runs them so (``fault:replica_groups``, e.g. ``fault=torchft``), else 1."""
    from plait.plugin_manager import provided

    if FAULT_REPLICA_GROUPS not in provided(hook):
        return 1
    return hook.plait_replica_groups(cfg=cfg, dims=dims) or 1


def group_size(dims, groups: int) -> int:
    """Processes per replica group (``dims``: the plan's layout of every rank)."""
    return dims.world_size // groups


def placement_problems(
    cfg, dims, groups: int, setting: str = "launcher.nproc_per_node"
) -> list[str]:
    """Every group must lie on one node, and every node hold whole groups (``setting``: the
    processes per node, as the launcher names them)."""
    size, per_node = group_size(dims, groups), cfg.launcher.nproc_per_node
    if per_node % size == 0:
        return []
    return [
        f"{setting}={per_node} does not hold whole replica groups of {size} processes "
        f"(strategy={cfg.strategy.name} forms {groups} groups): each group runs on one node as "
        f"its own torch job; set {setting} to a multiple of {size}"
    ]


def group_env(cfg, group: int, groups: int, size: int) -> dict[str, str]:
    """What a group's workers are told: their group, and on GPUs their group's devices."""
    env = {REPLICA_GROUP_ENV: f"{group} {groups}"}
    from plait.config import runs_on_cpu

    if not runs_on_cpu(cfg):
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        import torch

        devices = (
            visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
        )
        first = group % (cfg.launcher.nproc_per_node // size) * size
        env["CUDA_VISIBLE_DEVICES"] = ",".join(devices[first : first + size])
    return env


def group_worker(env: dict[str, str], entrypoint: Callable[..., Any], *args: Any) -> Any:
    """A replica group's worker: the group's environment, then the entry point."""
    os.environ.update(env)
    return entrypoint(*args)


def group_launch_config(cfg, size: int, log_dir: str):
    """torch elastic's ``LaunchConfig`` for one group: its own rendezvous on this machine, its
    workers' directories under ``log_dir``."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig

    launcher = cfg.launcher
    return LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=size,
        run_id=uuid.uuid4().hex,
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=launcher.max_restarts,
        start_method=launcher.start_method,
        monitor_interval=0.1,
        local_addr=launcher.local_addr,
        logs_specs=DefaultLogsSpecs(log_dir=log_dir),
    )


@contextmanager
def recorded_agents() -> Iterator[list]:
    """Within this block torch's ``launch_agent`` builds its agents as usual, and each is kept
    in the list yielded, so that a signal to this process can stop every group's workers."""
    from torch.distributed.launcher import api

    agents: list = []
    original = api.LocalElasticAgent

    def build(*args, **kwargs):
        agent = original(*args, **kwargs)
        agents.append(agent)
        return agent

    api.LocalElasticAgent = build
    try:
        yield agents
    finally:
        api.LocalElasticAgent = original


def launch_replica_groups(
    cfg,
    dims,
    groups: int,
    entrypoint: Callable[..., Any],
    args: tuple,
    wrap: Callable,
    log_dir: str,
) -> dict[int, Any]:
    """Run this node's replica groups, each with its own agent; ``wrap(entrypoint, args)`` is
    the launcher's own wrapping of a worker (the forkserver's); ``log_dir`` holds the agents'
    directories for their workers. Returns what every worker of the groups that finished
    returned, by the group's first global rank plus its rank; a group that ran out of restarts
    is reported, and fails the launch only if every group did."""
    from torch.distributed.launcher.api import elastic_launch

    size = group_size(dims, groups)
    per_node = cfg.launcher.nproc_per_node // size
    node = cfg.launcher.node_rank
    mine = range(node * per_node, (node + 1) * per_node)
    returned: dict[int, Any] = {}
    failed: dict[int, BaseException] = {}

    def run(group: int) -> None:
        worker, worker_args = wrap(
            group_worker, (group_env(cfg, group, groups, size), entrypoint, *args)
        )
        try:
            values = elastic_launch(group_launch_config(cfg, size, log_dir), entrypoint=worker)(
                *worker_args
            )
        except BaseException as error:  # noqa: BLE001 - the group's end, reported below
            failed[group] = error
            print(
                f"plait: replica group {group} ended ({type(error).__name__}); the other groups "
                "go on",
                file=sys.stderr,
                flush=True,
            )
            return
        returned.update({group * size + rank: value for rank, value in values.items()})

    with recorded_agents() as agents, stopped_by_signals(agents), no_thread_warning():
        threads = [
            threading.Thread(target=run, args=(g,), name=f"plait-replica-group-{g}") for g in mine
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            while thread.is_alive():
                thread.join(timeout=0.2)
    if len(failed) == len(mine):
        raise next(iter(failed.values()))
    return dict(sorted(returned.items()))


class DropThreadWarning(logging.Filter):
    """torch elastic warns that an agent off the main thread registers no signal handlers
    ("could lead to orphaned worker processes"): this launcher handles the signals itself."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Failed to register signal handlers" not in record.getMessage()


@contextmanager
def no_thread_warning() -> Iterator[None]:
    log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    dropped = DropThreadWarning()
    log.addFilter(dropped)
    try:
        yield
    finally:
        log.removeFilter(dropped)


class Stopped(Exception):
    """This launcher was stopped by a signal while its replica groups ran."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextmanager
def stopped_by_signals(agents: list) -> Iterator[None]:
    """SIGTERM or SIGINT stops every group's agent: no restart left, its workers stopped; the
    launch then ends with exit code 128 + the signal."""
    caught: list[int] = []

    def stop(signum, frame) -> None:
        caught.append(signum)
        for agent in agents:
            agent._remaining_restarts = 0
            agent._shutdown(signal.Signals(signum))
        raise Stopped(signum)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    except Stopped as stopped:
        print(
            f"plait: this node's replica groups were stopped by {stopped}",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(128 + stopped.signum) from None
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
