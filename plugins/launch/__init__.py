"""``launcher=local``: start ``launcher.nproc_per_node`` workers with torch's elastic launcher
(the machinery behind ``torchrun``), or, when an external launcher already started this process
(``torchrun``, a task of ``srun``), run the worker in place. In the batch step of an ``sbatch``
script (no ``srun``) it starts its workers as on any machine.

Multi-node: run the same command on every node with ``launcher.nnodes=N
launcher.master_addr=<node 0's address> launcher.master_port=<port> launcher.node_rank=<i>
run.name=<the same name on every node>``; the nodes meet at that address through the c10d
rendezvous. Where a node's host name does not resolve to its address on the others, give
``launcher.local_addr=<its address>``.

Elastic: ``launcher.nnodes=MIN:MAX`` (torchrun's syntax) hands torch elastic ``min_nodes`` and
``max_nodes``. A node lost fails the group; the agents left spend one of
``launcher.max_restarts`` (at least 1 is required), meet again in the c10d rendezvous and restart
at the smaller size from the last complete checkpoint (resharded). A node that joins a running
job makes the agents restart the group at the larger size (torch elastic's
``num_nodes_waiting``; no restart is spent). ``launcher.rdzv_conf`` passes torchrun's
``--rdzv-conf`` (``last_call_timeout``, ``join_timeout``, ``keep_alive_interval``, ...). The
accumulation that keeps the global batch is the core's (``plait.topology.
elastic_grad_accum_steps``); ``elastic.py`` reports each re-formed group. See docs/fault.md.
"""

from __future__ import annotations

import os
import sys
import tempfile
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from omegaconf import OmegaConf

from plait import hookimpl
from plait.config import AT_LEAST_0, LauncherConfig, Range, range_problems, runs_on_cpu
from plait.forkserver import START_METHODS
from plait.host_memory import preload, with_preload
from plait.plugins.launch.replica_groups import (
    launch_replica_groups,
    placement_problems,
    replica_groups,
)
from plait.plugins.launch.slurm import in_srun_task, task_count_problems, torch_env_from_slurm
from plait.types import PluginInfo


@dataclass
class LocalLauncherConfig(LauncherConfig):
    name: str = "local"
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: pick a free port (single node)
    local_addr: Optional[str] = None  # this node's address as the others reach it (multi-node)
    max_restarts: int = 0
    # torchrun's --start-method: "forkserver" forks every worker from one process that has
    # imported torch and the plugins (forkserver.py); "spawn" starts each as a fresh interpreter
    start_method: str = "forkserver"
    # torchrun's --rdzv-conf: c10d rendezvous settings; torch's defaults where not given
    # (last_call_timeout 30 s, join_timeout 600 s, keep_alive_interval 5 s x 3 attempts)
    rdzv_conf: Any = field(default_factory=lambda: OmegaConf.create({}, flags={"struct": False}))


RANGES = {
    "node_rank": AT_LEAST_0,
    "max_restarts": AT_LEAST_0,
    "master_port": Range(0, 65535, meaning="0: a free port, single node only"),
}


def started_externally() -> bool:
    """Under ``torchrun`` or as a task of ``srun`` (not the batch step of an sbatch script,
    which starts the workers itself)."""
    return "LOCAL_RANK" in os.environ or in_srun_task(os.environ)


@hookimpl
def plait_declare() -> PluginInfo:
    return PluginInfo(
        name="local_launcher",
        selected_by={"launcher.name": "local"},
        description="torch elastic launch on this node, or run in place under torchrun / srun",
    )


@hookimpl
def plait_register_configs(config_store) -> None:
    config_store.store(group="launcher", name="base_local", node=LocalLauncherConfig)


@hookimpl
def plait_validate(cfg, dims, hook) -> list[str]:
    launcher = cfg.launcher
    problems = range_problems("launcher", launcher, RANGES)
    if launcher.start_method not in START_METHODS:
        problems.append(
            f"launcher.start_method={launcher.start_method}: choose one of "
            f"{', '.join(START_METHODS)}"
        )
    nodes = dims.nodes
    if launcher.node_rank >= nodes.max:
        problems.append(
            f"launcher.node_rank={launcher.node_rank} with launcher.nnodes="
            f"{launcher.nnodes}: give each node its rank, 0 to {nodes.max - 1}"
        )
    if not started_externally():
        if nodes.max > 1 and launcher.master_port == 0:
            problems.append(
                f"launcher.nnodes={launcher.nnodes} needs launcher.master_port=<port>: "
                "the port node 0 listens on for the rendezvous, the same on every "
                "node (e.g. 29500)"
            )
        if nodes.elastic and launcher.max_restarts < 1:
            problems.append(
                f"launcher.nnodes={launcher.nnodes} goes on after a node leaves by "
                "restarting the group at the smaller size, which spends a restart: "
                "set launcher.max_restarts >= 1 (one per node that may leave)"
            )
    return problems + group_problems(cfg, dims, hook) + gpu_problems(cfg)


def group_problems(cfg, dims, hook) -> list[str]:
    """Replica groups run as jobs of their own (``fault:replica_groups``) by plait's launcher:
    whole groups on every node, and no ``torchrun`` or ``srun`` around (each group needs its own
    agent); otherwise the task-count check of a job started under ``srun``."""
    groups = replica_groups(cfg, dims, hook)
    if groups == 1:
        return task_count_problems(cfg, dims, os.environ)
    if started_externally():
        return [
            f"fault={cfg.fault.name} runs each of the {groups} replica groups as its own torch "
            "job with its own agent, which plait's launcher starts: run `plait train` itself "
            "(one per node), not under torchrun or srun (launcher=slurm starts the groups in a "
            "SLURM allocation)"
        ]
    return placement_problems(cfg, dims, groups)


def gpu_problems(cfg) -> list[str]:
    """Each process takes the GPU of its local rank (``cuda:LOCAL_RANK``): refuse a node with
    fewer GPUs than processes before rank 1 asks for a ``cuda:1`` that is not there."""
    import torch

    if cfg.device == "cpu" or not torch.cuda.is_available():
        return []  # device=cuda without a GPU: the core refuses it
    if started_externally():  # torchrun says; srun does with --ntasks-per-node
        processes = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("SLURM_NTASKS_PER_NODE")
    else:
        processes = cfg.launcher.nproc_per_node
    gpus = torch.cuda.device_count()
    if processes is None or gpus >= int(processes):
        return []
    return [
        f"device={cfg.device} gives each process the GPU of its local rank, but this node has "
        f"{gpus} GPU(s) for {processes} processes (launcher.nproc_per_node={processes}): "
        f"set launcher.nproc_per_node={gpus}, or device=cpu"
    ]


@hookimpl
def plait_launch(cfg, dims, entrypoint, args, hook) -> dict[int, Any]:
    launcher = cfg.launcher
    if started_externally():
        os.environ.update(torch_env_from_slurm(os.environ, launcher.master_port))
        return {int(os.environ["RANK"]): entrypoint(*args)}

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    from plait.plugins.launch.out_of_memory import oom_kill_count, out_of_memory
    from plait.plugins.launch.rendezvous_events import name_events_from_frames

    name_events_from_frames()

    # As torchrun does: without a limit each worker's intra-op pool takes every core, and
    # workers sharing a machine slow each other down many times over. Set for this launch only:
    # left in this process, a later launch with more processes (a sweep, a test session) would
    # inherit a 1-process job's count (seen: 2 threads per worker of 2 on 2 cores, whose compute
    # then read 20x its CPU time spinning at OpenMP barriers).
    threads_given = "OMP_NUM_THREADS" in os.environ
    os.environ.setdefault(
        "OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // launcher.nproc_per_node))
    )
    if dims.elastic:
        # torch 2.13's shared rendezvous TCPStore breaks a re-formed group with a new member:
        # the host's agent publishes MASTER_ADDR for the first round only, so a node joining a
        # later round waits for it forever (seen: scale-up restart, both agents timed out). Not
        # sharing it makes each round publish a fresh store address (and key space).
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    # The agent (this process), for a worker that makes its node leave an elastic job
    # (plait.plugins.fault.membership): a forkserver's worker is not the agent's child.
    os.environ["PLAIT_AGENT_PID"] = str(os.getpid())
    # launcher.allocator: jemalloc or tcmalloc preloaded into CPU workers (plait.host_memory)
    environ_before = dict(os.environ)
    on_cpu = runs_on_cpu(cfg)
    library = preload(launcher.allocator) if on_cpu else None
    os.environ.update(with_preload(environ_before, library))

    def wrap(entrypoint, args):
        """A worker as this launcher starts it: forked from the forkserver, or spawned."""
        if launcher.start_method != "forkserver":
            return entrypoint, args
        from plait.forkserver import launcher_stdio, use_forkserver, worker_entry

        declared = {m for info in hook.plait_declare() for m in info.preload}
        use_forkserver(declared, on_cpu=on_cpu, ld_preload=os.environ.get("LD_PRELOAD"))
        return worker_entry, (entrypoint, dict(os.environ), launcher_stdio(), *args)

    expendable = expendable_ranks(cfg, dims, hook)
    groups = replica_groups(cfg, dims, hook)
    # torch elastic's per-worker directories (error files; logs under redirects, which plait
    # does not use): torch makes them in a fresh temp directory per launch and leaves them there,
    # one tree per run; plait's is removed when the launch ends (an error removing it hides no
    # error of the run).
    logs = tempfile.TemporaryDirectory(prefix="torchelastic_", ignore_cleanup_errors=True)
    oom_kills_before = oom_kill_count()
    try:
        if groups > 1:  # each replica group its own torch job, with its own agent
            return launch_replica_groups(cfg, dims, groups, entrypoint, args, wrap, logs.name)
        entrypoint, args = wrap(entrypoint, args)
        launch = elastic_launch(launch_config(cfg, dims, logs.name), entrypoint=entrypoint)
        if expendable is None:
            return launch(*args)
        from plait.plugins.launch.departures import agent_class

        with agent_class(expendable):
            return launch(*args)
    except ChildFailedError as failed:
        # a worker the kernel killed for memory reads as a bare SIGKILL: say so, and what fits
        allocator = launcher.allocator if on_cpu else None
        told = out_of_memory(
            failed,
            oom_kills_before,
            allocator,
            launcher.decommit_above,
            launcher.nproc_per_node,
            dims.world_size,
        )
        if told is None:
            raise
        raise told from None
    except SignalException as stopped:
        # the agent was stopped (a scheduler, Ctrl-C, or a worker of this node that leaves an
        # elastic job: plait.plugins.fault.membership); it stopped its workers and, unlike a
        # finished job, left the rendezvous open for the other nodes
        print(
            f"plait: this node's agent was stopped by {stopped.sigval.name}; its workers are "
            "stopped",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(128 + stopped.sigval) from None
    finally:
        logs.cleanup()
        if not threads_given:
            os.environ.pop("OMP_NUM_THREADS", None)
        if "LD_PRELOAD" in environ_before:
            os.environ["LD_PRELOAD"] = environ_before["LD_PRELOAD"]
        else:
            os.environ.pop("LD_PRELOAD", None)


def launch_config(cfg, dims, log_dir: str):
    """torch elastic's ``LaunchConfig`` for this node, as ``torchrun`` would build it, its
    workers' directories under ``log_dir``."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig

    launcher = cfg.launcher
    nodes = dims.nodes
    if nodes.max == 1 and launcher.master_port == 0:
        endpoint = "localhost:0"  # torchrun --standalone: a free port on this machine
    else:
        endpoint = f"{launcher.master_addr}:{launcher.master_port}"
    rdzv_configs = dict(launcher.rdzv_conf)
    if nodes.max > 1:  # node 0 hosts the rendezvous store: the node that must not leave
        rdzv_configs["is_host"] = launcher.node_rank == 0
    return LaunchConfig(
        min_nodes=nodes.min,
        max_nodes=nodes.max,
        nproc_per_node=launcher.nproc_per_node,
        run_id=f"plait-{cfg.run.name}" if nodes.max > 1 else uuid.uuid4().hex,
        rdzv_backend="c10d",
        rdzv_endpoint=endpoint,
        rdzv_configs=rdzv_configs,
        max_restarts=launcher.max_restarts,
        start_method=launcher.start_method,
        monitor_interval=0.1,
        local_addr=launcher.local_addr,
        logs_specs=DefaultLogsSpecs(log_dir=log_dir),
    )


def expendable_ranks(cfg, dims, hook) -> Callable[[int], frozenset[int]] | None:
    """The ranks whose death the strategy survives (``Roles.expendable``), by world size; None
    when it declares none (torch's own agent then runs, as for every strategy without roles)."""

    def expendable(world_size: int) -> frozenset[int]:
        roles = hook.plait_assign_roles(cfg=cfg, world_size=world_size)
        return frozenset(roles.expendable) if roles is not None else frozenset()

    launched = dims.nodes.max * cfg.launcher.nproc_per_node
    return expendable if expendable(launched) else None
