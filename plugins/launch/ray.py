"""``launcher=ray``: run the workers on a Ray cluster through Ray Train's ``TorchTrainer``.

    plait train launcher=ray launcher.address=auto launcher.nnodes=2 launcher.nproc_per_node=4
    plait train launcher=ray launcher.address=ray://head:10001 launcher.max_restarts=2 ...
    plait train launcher=ray launcher.nproc_per_node=2      # no address: a local Ray plait starts,
                                                            # even beside RAY_ADDRESS

``launcher.nnodes x launcher.nproc_per_node`` workers (``ScalingConfig.num_workers``), each a Ray
actor holding ``launcher.resources_per_worker`` (default one CPU, or one GPU with
``device=cuda``), placed by ``launcher.placement_strategy`` (Ray's ``PACK``: as few nodes as the
resources allow, so give each worker the share of a node that fits ``nproc_per_node`` on it).
Ray Train starts the workers, sets torch's ``env://`` variables and joins them in one process
group (gloo, or NCCL on GPUs; ``launcher.timeout_s``); each worker then runs plait's worker
entry point, whose topology takes that group as it is. Ray's node rank becomes torch elastic's
``GROUP_RANK`` (:func:`torch_env_from_ray`), which is all plait's topology needs to learn the
nodes, as under ``srun``.

**Restarts.** ``launcher.max_restarts=N`` is Ray Train's ``FailureConfig(max_failures=N)``: when
a worker dies (an exception, SIGKILL, its node lost) Ray stops the group and starts a new one,
up to N times. The new workers resume from the run directory's newest complete checkpoint
(``resume=auto``), exactly as after a restart by torch elastic: each worker is told the attempt
in ``TORCHELASTIC_RESTART_COUNT``, torch elastic's variable for the same count, so the
``restarts`` metric and the checkpoint plugin's restart handling are the same under both. The
W&B run id lives in the checkpoint, so a job keeps one W&B run across restarts.

**Why Ray Train and not plain actors.** Ray Train already does what a launcher needs: a placement
group for the workers, ranks sorted by node (``LOCAL_RANK``, ``NODE_RANK``), the torch process
group, the detection of a dead worker or node, and the restart of the whole group
(``FailureConfig``) -- the parts plait would otherwise write around ``ray.remote`` actors
(as veRL and OpenRLHF do for their own role-based layouts). plait's worker is an ordinary
``train_loop_per_worker``; no Ray Train checkpoint or report is used (plait's checkpoints are
its own, in ``run.dir``, which must be on storage every node sees, as for any multi-node run).

Refused before anything starts (``plait_validate``): no Ray cluster answering at
``launcher.address``; ``launcher.nnodes=MIN:MAX`` (Ray Train's elastic range counts workers, not
nodes, and plait's accumulation over node counts was not tried with it).
"""

from __future__ import annotations

import importlib.util
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

from plait import hookimpl
from plait.config import AT_LEAST_0, AT_LEAST_1, LauncherConfig, range_problems, runs_on_cpu
from plait.types import PluginInfo

PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
# The driver's variables a worker on any node needs as the driver has them: plait's and the
# libraries' own settings, and where the run's plugins are importable from.
FORWARDED_PREFIXES = ("PLAIT_", "WANDB_", "DS_", "OMP_", "HF_")
FORWARDED_NAMES = ("PYTHONPATH",)
LOCAL_OBJECT_STORE_BYTES = 128 * 2**20  # plait passes configs and summaries, not tensors


@dataclass
class RayLauncherConfig(LauncherConfig):
    name: str = "ray"
    # auto: the cluster of RAY_ADDRESS or the one `ray start` left on this machine;
    # ray://host:10001 (Ray client) or host:6379 (a GCS address); None: a local Ray plait starts
    address: Optional[str] = None
    max_restarts: int = 0  # Ray Train's FailureConfig(max_failures)
    # Ray resources of each worker; None: {CPU: 1}, or {GPU: 1} with device=cuda
    resources_per_worker: Any = None
    placement_strategy: str = "PACK"
    num_cpus: Optional[int] = None  # CPUs of the local Ray plait starts; None: enough for all


RANGES = {"max_restarts": AT_LEAST_0, "num_cpus": AT_LEAST_1}


@hookimpl
def plait_declare() -> PluginInfo:
    return PluginInfo(
        name="ray_launcher",
        selected_by={"launcher.name": "ray"},
        description="run the workers on a Ray cluster through Ray Train's "
        "TorchTrainer (restarts: FailureConfig)",
    )


@hookimpl
def plait_register_configs(config_store) -> None:
    config_store.store(group="launcher", name="base_ray", node=RayLauncherConfig)


@hookimpl
def plait_validate(cfg, dims) -> list[str]:
    launcher = cfg.launcher
    problems = range_problems("launcher", launcher, RANGES)
    if importlib.util.find_spec("ray") is None:
        return problems + [
            "launcher=ray needs Ray Train, which is not installed: pip install "
            "'ray[train]' (plait's extra: pip install 'plait[ray]')"
        ]
    if launcher.placement_strategy not in PLACEMENT_STRATEGIES:
        problems.append(
            f"launcher.placement_strategy={launcher.placement_strategy}: choose one "
            f"of {', '.join(PLACEMENT_STRATEGIES)}"
        )
    if dims.nodes.elastic:
        problems.append(
            f"launcher.nnodes={launcher.nnodes} under launcher=ray: Ray Train's elastic range "
            "counts workers, not nodes, and plait's accumulation over node counts has not been "
            "run with it; give a fixed launcher.nnodes (or use launcher=local or "
            "launcher=kubernetes with a PyTorchJob for an elastic job)"
        )
    if launcher.address is not None:
        problems += cluster_problems(launcher.address, os.environ)
    return problems


def cluster_problems(address: str, environ: Mapping[str, str]) -> list[str]:
    """Whether a Ray cluster answers at ``address`` (``auto``, ``ray://host:port`` or
    ``host:port``): one TCP connection to its GCS or client server, nothing submitted."""
    given = address
    if address == "auto":
        address = environ.get("RAY_ADDRESS") or current_cluster_address()
        if not address or address == "auto":
            return [
                f"launcher.address={given}: no Ray cluster found (RAY_ADDRESS is not set and "
                "`ray start --head` was not run on this machine): start one, give its "
                "address (launcher.address=ray://<head>:10001), or leave launcher.address "
                "unset for a local Ray that plait starts"
            ]
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=3):
            return []
    except (OSError, ValueError) as error:
        reason = error.strerror or str(error) if isinstance(error, OSError) else "no port"
        return [
            f"launcher.address={given}: no Ray cluster answers at {address} ({reason}): "
            "start one there (`ray start --head`), correct the address, or leave "
            "launcher.address unset for a local Ray that plait starts"
        ]


def current_cluster_address() -> str | None:
    """The GCS address ``ray start --head`` wrote on this machine (what Ray's ``auto`` reads)."""
    from ray._private.utils import read_ray_address

    return read_ray_address()


def torch_env_from_ray(context: Any) -> dict[str, str]:
    """torch elastic's node variables from Ray Train's context: Ray sets ``RANK``,
    ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``,
    but names the node rank ``NODE_RANK``; plait's topology reads torch elastic's
    ``GROUP_RANK``."""
    return {
        "GROUP_RANK": str(context.get_node_rank()),
        "LOCAL_RANK": str(context.get_local_rank()),
        "LOCAL_WORLD_SIZE": str(context.get_local_world_size()),
    }


def worker_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables every worker gets: the driver's that plait and its libraries read, and Ray
    Train's print patch off (it sends a worker's prints to a logger that Ray also echoes to the
    driver: every line twice)."""
    forwarded = {
        k: v for k, v in environ.items() if k.startswith(FORWARDED_PREFIXES) or k in FORWARDED_NAMES
    }
    return {**forwarded, "RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}


@hookimpl
def plait_launch(cfg, dims, entrypoint, args) -> dict[int, Any]:
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    launcher = cfg.launcher
    on_cpu = runs_on_cpu(cfg)
    workers = dims.nodes.max * launcher.nproc_per_node
    resources = dict(launcher.resources_per_worker or ({"CPU": 1} if on_cpu else {"GPU": 1}))
    env = worker_env(os.environ)
    started = not ray.is_initialized()
    if started:
        if launcher.address is None:  # a local Ray, started in this process and ended with it
            if named := os.environ.get("RAY_ADDRESS"):
                print(
                    "plait: launcher.address is unset, so this run starts a local Ray; "
                    f"RAY_ADDRESS={named} is not joined (launcher.address=auto joins it)",
                    file=sys.stderr,
                    flush=True,
                )
            ray.init(
                # "local": a new Ray even where RAY_ADDRESS names a cluster or `ray start` left
                # one on this machine (Ray's default joins those, and refuses num_cpus there)
                address="local",
                num_cpus=launcher.num_cpus
                or max(os.cpu_count() or 1, int(workers * resources.get("CPU", 0))),
                include_dashboard=False,
                object_store_memory=LOCAL_OBJECT_STORE_BYTES,
                runtime_env={"env_vars": env},
            )
        else:
            ray.init(address=launcher.address, runtime_env={"env_vars": env})
    board = ray.remote(RunBoard).options(num_cpus=0).remote()
    try:
        trainer = TorchTrainer(
            ray_worker,
            train_loop_config={"entrypoint": entrypoint, "args": args, "board": board},
            torch_config=TorchConfig(
                backend="gloo" if on_cpu else "nccl", timeout_s=launcher.timeout_s
            ),
            scaling_config=ScalingConfig(
                num_workers=workers,
                use_gpu=not on_cpu,
                resources_per_worker=resources,
                placement_strategy=launcher.placement_strategy,
            ),
            run_config=RunConfig(
                name="ray",
                storage_path=str(Path(cfg.run.dir).absolute()),
                failure_config=FailureConfig(max_failures=launcher.max_restarts),
                worker_runtime_env={"env_vars": env},
            ),
        )
        trainer.fit()  # raises Ray Train's error once launcher.max_restarts are spent
        return ray.get(board.summaries.remote())
    finally:
        ray.kill(board)
        if started:
            ray.shutdown()


def ray_worker(config: dict[str, Any]) -> None:
    """Ray Train's ``train_loop_per_worker``: plait's worker entry point in a Ray Train worker
    whose process group Ray has joined."""
    import ray
    import ray.train
    import torch.distributed as dist

    context = ray.train.get_context()
    os.environ.update(torch_env_from_ray(context))
    # the attempt, counted by rank 0 and told to every rank over Ray's process group
    attempt = [
        ray.get(config["board"].start_attempt.remote()) if context.get_world_rank() == 0 else None
    ]
    dist.broadcast_object_list(attempt, src=0)
    os.environ["TORCHELASTIC_RESTART_COUNT"] = str(attempt[0])
    summary = config["entrypoint"](*config["args"])
    if summary is not None:  # the logging rank
        ray.get(config["board"].put.remote(context.get_world_rank(), summary))


class RunBoard:
    """The driver's side of a job, a Ray actor: the attempts started and the logging rank's
    summary (Ray Train keeps only metrics reported with a checkpoint)."""

    def __init__(self) -> None:
        self.attempts = 0
        self.returned: dict[int, Any] = {}

    def start_attempt(self) -> int:
        self.attempts += 1
        return self.attempts - 1

    def put(self, rank: int, summary: Any) -> None:
        self.returned = {rank: summary}  # a later attempt's replaces an earlier one's

    def summaries(self) -> dict[int, Any]:
        return self.returned
