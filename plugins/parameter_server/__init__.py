"""``strategy=parameter_server``: data parallelism through parameter servers, synchronous or
asynchronous (TensorFlow's ``ParameterServerStrategy``, MXNet's ``dist_sync`` / ``dist_async``
KVStore, BytePS).

    plait train strategy=parameter_server strategy.servers=1 launcher.nproc_per_node=3
    plait train strategy=parameter_server strategy.mode=async strategy.max_staleness=4

The first ``strategy.servers`` ranks are servers (``plait_assign_roles``); they hold the
parameters, sharded by bytes (``sharding.py``), and apply the optimizer to their shard
(``server.py``). The other ranks are workers: the trainers of the core's train loop, with the
engine in ``worker.py``. Tensors travel point to point (``isend``/``irecv`` on gloo or nccl); the
job's ``TCPStore`` carries the asynchronous inbox queues and the figures the logging worker
sends to the trackers (``store.py``). ``torch.distributed.rpc`` is not used: its maintainers
have put it in maintenance mode.
"""

from __future__ import annotations

from dataclasses import dataclass

from plait import hookimpl
from plait.config import AT_LEAST_0, AT_LEAST_1, StrategyConfig, range_problems
from plait.topology import TRAINER, Roles
from plait.types import PluginInfo

MODES = ("sync", "async")
SERVER = "server"


@dataclass
class ParameterServerConfig(StrategyConfig):
    name: str = "parameter_server"
    servers: int = 1  # the first `servers` ranks hold the parameters; the rest are workers
    mode: str = "sync"  # sync: every step averages all workers | async: each push applied alone
    # async: a gradient computed on parameters more than this many server updates old is
    # dropped (the worker gets fresh parameters and goes on)
    max_staleness: int = 4


RANGES = {"servers": AT_LEAST_1, "max_staleness": AT_LEAST_0}


@hookimpl
def plait_declare() -> PluginInfo:
    return PluginInfo(
        name="parameter_server",
        selected_by={"strategy.name": "parameter_server"},
        parallel_axes=frozenset({"dp"}),
        precisions=frozenset({"fp32", "bf16"}),
        description="parameter servers (sync or async), sharded by bytes, point-to-point",
    )


@hookimpl
def plait_register_configs(config_store) -> None:
    config_store.store(group="strategy", name="base_parameter_server", node=ParameterServerConfig)


@hookimpl
def plait_assign_roles(cfg, world_size: int) -> Roles:
    servers = cfg.strategy.servers
    if servers >= world_size:
        raise ValueError(
            f"strategy.servers={servers} leaves no worker among the {world_size} processes "
            f"launched: set strategy.servers below {world_size}, or launch more processes "
            "(launcher.nproc_per_node / launcher.nnodes)"
        )
    workers = tuple(range(servers, world_size))
    sync = cfg.strategy.mode == "sync"
    # async: a worker other than the first (which logs, checkpoints and ends the servers) may
    # die and the job goes on without it (server.py notices); sync needs every worker each step
    return Roles(
        {SERVER: tuple(range(servers)), TRAINER: workers},
        lockstep=sync,
        expendable=() if sync else workers[1:],
    )


@hookimpl
def plait_validate(cfg) -> list[str]:
    settings = cfg.strategy
    problems = range_problems("strategy", settings, RANGES)
    if settings.mode not in MODES:
        problems.append(
            f"strategy.mode={settings.mode}: choose sync (every step averages every "
            "worker's gradient) or async (workers go at their own pace)"
        )
    return problems


@hookimpl
def plait_run_role(cfg, topology, hook) -> bool | None:
    if topology.role != SERVER:
        return None
    from plait.plugins.parameter_server.server import Server

    Server(cfg, topology, hook).serve()
    return True


@hookimpl
def plait_on_run_end(cfg) -> None:
    """The first worker's run ended (its final checkpoint written): the servers may stop once
    they have served every push."""
    from plait.plugins.parameter_server.store import inbox, job_store

    store = job_store()
    for server in range(cfg.strategy.servers):
        store.queue_push(inbox(server), "end")


@hookimpl
def plait_build_engine(cfg, model, loss_fn, topology):
    from plait.plugins.parameter_server.worker import WorkerEngine

    return WorkerEngine(cfg, model, loss_fn, topology)
