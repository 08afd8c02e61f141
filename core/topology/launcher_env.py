"""What the launcher tells a worker: which node it runs on and where (torch elastic's
variables), and the rendezvous store of this restart."""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist

LAUNCHER_ENV = ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")


def launcher_node_env(environ: dict[str, str]) -> tuple[int, int, int]:
    """``(node_rank, local_rank, local_world_size)`` as the launcher set them.

    torch elastic (``plait train``, ``torchrun``) sets all three; under ``srun`` plait's launcher
    derives them from ``SLURM_NODEID``, ``SLURM_LOCALID`` and ``SLURM_TASKS_PER_NODE``.
    """
    missing = [name for name in LAUNCHER_ENV if name not in environ]
    if missing:
        raise ValueError(
            f"{', '.join(missing)} not set: plait learns the nodes from the launcher; start the "
            "workers with `plait train`, `torchrun` or `srun ... plait train`"
        )
    return (
        int(environ["GROUP_RANK"]),
        int(environ["LOCAL_RANK"]),
        int(environ["LOCAL_WORLD_SIZE"]),
    )


def restart_safe_store(timeout: timedelta) -> dist.Store | None:
    """The rendezvous store with this restart's own key space, under torch elastic's shared store.

    torch elastic (``torchrun``, plait's launcher) hands workers the agent's rendezvous TCPStore
    (``TORCHELASTIC_USE_AGENT_STORE=True``); it outlives a restart, so a restarted worker can read
    the previous attempt's process-group keys (a dead peer's gloo address) and fail in
    ``connectFullMesh`` (pytorch/pytorch#135712). Prefixing every key with the restart count
    gives each attempt a fresh key space. None: not under torch elastic's shared store.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout
    )
    return dist.PrefixStore(f"plait/attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}", store)
