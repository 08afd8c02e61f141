"""One replica group's side of ``fault=torchft``, on every rank: torchft's ``Manager`` joins
each step's quorum, averages the gradients over the groups in it and commits the step; a group
that is behind receives a healthy peer's state over the network.

Per step (``use_async_quorum=False``: the quorum is formed before the step's batch is drawn, so
a recovering group takes part in the very step it recovers in)::

    start_quorum()        the lighthouse's quorum; the process group across the groups
                          (torchft's ProcessGroupGloo / ProcessGroupNCCL) reconfigured on a change;
                          a group behind the quorum's highest step fetches the peer's state
    allreduce(grads)      after the strategy's own reduction inside the group: the sum over the
                          quorum's groups of each gradient divided by their number (torchft's
                          normalization; the engine divides as it fills the buffer, sum())
    should_commit()       every rank of the group and the quorum's health agree; a failed
                          collective (a peer died in the step) makes the step not taken

What a recovering group receives (torchft's HTTP transport: each rank from the same rank of the
peer): the engine's own state of that rank (:meth:`local_state`: model, optimizer, loss scaler,
exactly what its checkpoint file holds), the peer's ``TrainState`` (step, data position, tokens)
and every random generator (:mod:`plait.engine.rng`); torchft's manager state (its step) comes
with it. Equal bit for bit to the peer's, which sends its live tensors while it waits for the
recovering group in the step's first collective.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import sys
import time
import warnings
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from plait.engine.rng import rng_state, set_rng_state
from plait.plugins.fault.torchft.lighthouse import LIGHTHOUSE_ENV, quiet_rust_logs
from plait.plugins.fault.torchft.stragglers import GroupStragglers, ReplicaGroupLeaves
from plait.types import TrainState

STATE_KEY = "plait"


class KnownNoise(logging.Filter):
    """torchft's manager warns on every quorum change that it cannot reset NCCL's flight
    recorder (torch builds without it, gloo): nothing to act on."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Unable to reset NCCL flight recorder" not in record.getMessage()


def quiet_torchft() -> None:
    logging.getLogger("torchft.manager").addFilter(KnownNoise())
    # torchft's HTTP transport loads the received bytes into tensors through a read-only buffer,
    # and torch says so once per process; the tensors are copied into the engine's own
    warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)


def heartbeat_interval(heartbeat_timeout_ms: int) -> timedelta:
    """How often a group's manager tells the lighthouse it lives: ten times per
    ``fault.heartbeat_timeout_ms``, never more often than torchft's default 100 ms. (torchft's
    fixed 100 ms beside the 5 s timeout made each manager and the lighthouse wake 10 times a
    second for nothing: CPU taken from the training processes on a small machine.)"""
    return timedelta(milliseconds=max(100, heartbeat_timeout_ms // 10))


class GuardSkipped(RuntimeError):
    """A step guard (``plait_check_step``) skipped the step: this group does not commit it."""


def group_store(host: str) -> tuple[dist.TCPStore | None, int]:
    """A fresh store for this attempt of the group's torch job, where torchft's managers meet
    (its first rank's manager address) and other groups configure the process group across the
    groups: the rendezvous store of torch elastic outlives a restart, so a restarted rank could
    read the previous attempt's manager address. Made by rank 0 (returned there, to be kept
    alive), its port told to the others."""
    store = (
        dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
        if dist.get_rank() == 0
        else None
    )
    port = [store.port if store is not None else 0]
    dist.broadcast_object_list(port, src=0)
    return store, port[0]


@dataclass
class QuorumRecord:
    """What the last quorum was, for the metrics and the console."""

    participants: int = 0
    quorum_id: int = -1
    changes: int = 0  # quorum changes this group has seen since the last logged step
    recovered_at: int | None = None  # the step this group received from a peer
    waited_s: float = 0.0  # in start_quorum
    history: list[tuple[int, int]] = field(default_factory=list)  # (step, participants)


class ReplicaGroups:
    """torchft's ``Manager`` for this rank's replica group; the engine's
    :class:`plait.types.ReplicaSync`."""

    def __init__(self, cfg, engine, topology):
        quiet_rust_logs()
        quiet_torchft()
        from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL

        fault = cfg.fault
        self.engine, self.topology = engine, topology
        self.groups = topology.dims.replica_groups
        self.state: TrainState | None = None
        self.received: TrainState | None = None
        self.joined_before_load = False
        self.record = QuorumRecord()
        self.stragglers = GroupStragglers(
            cfg, self.groups, topology.replica_group_id, topology.device
        )
        self.straggler: tuple[int, float] | None = None  # (group, slowdown) while one is named
        timeout = timedelta(seconds=fault.manager_timeout_s)
        host = cfg.launcher.get("local_addr") or socket.gethostname()
        self.store, store_port = group_store(host)
        process_group = (
            ProcessGroupNCCL(timeout=timeout)
            if topology.device.type == "cuda"
            else ProcessGroupGloo(timeout=timeout)
        )
        self.manager = Manager(
            pg=process_group,
            load_state_dict=None,
            state_dict=None,
            min_replica_size=fault.min_replicas,
            use_async_quorum=False,
            timeout=timeout,
            quorum_timeout=timedelta(seconds=fault.quorum_timeout_s),
            connect_timeout=timeout,
            rank=dist.get_rank(),
            world_size=dist.get_world_size(),
            store_addr=host,
            store_port=store_port,
            lighthouse_addr=os.environ[LIGHTHOUSE_ENV],
            replica_id=f"plait_replica_group_{topology.replica_group_id}",
            hostname=host,
            init_sync=False,  # every group builds the same seeded weights
            heartbeat_interval=heartbeat_interval(fault.heartbeat_timeout_ms),
        )
        self.manager.register_state_dict_fn(STATE_KEY, self._load, self._state)
        atexit.register(self.manager.shutdown, wait=False)

    # -- plait.types.ReplicaSync ------------------------------------------------------------

    def average(self, tensor: torch.Tensor) -> torch.Tensor:
        self.manager.allreduce(tensor).wait()
        return tensor

    def participants(self) -> int:
        return self.manager.num_participants()

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        self.manager.allreduce(tensor, reduce_op=dist.ReduceOp.SUM).wait()
        return tensor

    def commit(self, ok: bool) -> bool:
        if not ok:
            self.manager.report_error(GuardSkipped("a step guard skipped the step"))
        return self.manager.should_commit()

    # -- the quorum ----------------------------------------------------------------------------

    def sync(self, state: TrainState | None) -> TrainState | None:
        """Join the next step's quorum; the state received from a peer, if this group was
        behind. Before the checkpoint is loaded (``state`` None) this is the first step's
        quorum, which the loop's first call then does not join again."""
        if state is not None and self.joined_before_load:
            self.joined_before_load = False
            return None
        if state is not None:
            self.straggler = self.judge_stragglers(state.step)
        self.joined_before_load = state is None
        self.state, self.received = state, None
        started = time.perf_counter()
        self.manager.start_quorum()
        self.record.waited_s = time.perf_counter() - started
        self._note_quorum(state)
        return self.received

    def judge_stragglers(self, step: int) -> tuple[int, float] | None:
        """The straggler among the groups after ``step``; an excluded group leaves here, its
        manager shut down first (its heartbeats stop, so the others' quorum forms sooner)."""
        try:
            return self.stragglers.judge(self.manager, step, self.topology.is_logging_rank)
        except ReplicaGroupLeaves as leaving:
            if self.topology.is_logging_rank:
                print(leaving.message, file=sys.stderr, flush=True)
            self.manager.shutdown(wait=False)
            raise

    def loaded(self, state: TrainState) -> None:
        """A checkpoint was loaded after the first quorum: torchft's step is the run's."""
        self.manager.load_state_dict({"step": state.step, "batches_committed": 0})

    @property
    def quorum_rank(self) -> int | None:
        """This group's place among the groups of the step's quorum (None: not in it)."""
        return self.manager.participating_rank()

    def _note_quorum(self, state: TrainState | None) -> None:
        record = self.record
        participants = self.manager.num_participants()
        quorum_id = getattr(self.manager, "_quorum_id", -1)  # torchft 0.2 has no accessor
        step = self.received.step if self.received is not None else (state.step if state else 0)
        if quorum_id != record.quorum_id:
            if record.quorum_id != -1:
                record.changes += 1
            if self.topology.is_logging_rank and participants != record.participants:
                print(
                    f"plait: replica group {self.topology.replica_group_id}: quorum of "
                    f"{participants} of {self.groups} replica groups from step {step + 1}"
                    + (f" (was {record.participants})" if record.participants else ""),
                    file=sys.stderr,
                    flush=True,
                )
            record.quorum_id, record.participants = quorum_id, participants
            record.history.append((step + 1, participants))
        if self.received is not None:
            record.recovered_at = self.received.step
            if self.topology.is_logging_rank:
                print(
                    f"plait: replica group {self.topology.replica_group_id} recovered live from a "
                    f"peer at step {self.received.step} (no checkpoint read)",
                    file=sys.stderr,
                    flush=True,
                )

    def metrics(self) -> dict[str, float]:
        """The quorum figures of the logged step: its groups, the groups configured, the changes
        this group saw since the last logged step, whether it recovered, the wait."""
        record = self.record
        figures = {
            "quorum/participants": float(record.participants),
            "quorum/replica_groups": float(self.groups),
            "quorum/changes": float(record.changes),
            "quorum/recovered": float(record.recovered_at is not None),
            "quorum_s": record.waited_s,
        }
        if self.straggler is not None:
            group, slowdown = self.straggler
            figures["straggler/group"], figures["straggler/slowdown"] = float(group), slowdown
        record.changes, record.recovered_at = 0, None
        return figures

    # -- what a recovering group receives --------------------------------------------------------

    def _state(self) -> dict:
        """This rank's state as a peer takes it (called in torchft's quorum thread, while the
        main thread waits for the quorum: no collective)."""
        return {
            "engine": self.engine.local_state(),
            "train": (self.state or TrainState()).to_dict(),
            "rng": rng_state(),
        }

    def _load(self, received: dict) -> None:
        """A peer's state, on the main thread (torchft applies it in ``start_quorum``)."""
        self.engine.load_local_state(received["engine"])
        set_rng_state(received["rng"])
        self.received = TrainState.from_dict(received["train"])
