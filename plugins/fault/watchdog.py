"""``fault.collective_timeout_s=T``: a collective that waits longer than T fails the job, saying which
rank did not arrive or which node was lost, instead of hanging.

Two parts:

- **torch's process-group timeouts.** Once the engine is built, every process group of the job
  gets T (``torch.distributed.distributed_c10d._set_pg_timeout``: the default group, the mesh's
  dp/tp/pp groups, the comm plugin's intra-/inter-node groups, DeepSpeed's), and groups made
  later default to it. Without this, every group but the default one keeps gloo's default of
  30 minutes whatever ``launcher.timeout_s`` says, which is why a cut link between two nodes
  running ``comm=hierarchical`` hung for more than 300 s. gloo then raises in the waiting rank
  ("Timed out waiting T ms for recv operation"), without saying for whom it waited.
- **a heartbeat.** Each rank's watchdog thread publishes, every ``T/10`` s (0.2 to 2 s), where
  its main thread is (``phases.progress``: step, micro-batch, phase, gradients so far) to the job's
  rendezvous store, over a client of its own with a short timeout. When a collective fails, or
  when this rank's main thread has not moved for T plus three heartbeats (where gloo cannot time
  out: a rank stuck outside any collective, collectives queued behind a stuck one, each timed
  from its own start), the rank reads everyone's heartbeat twice, three heartbeats apart:

      a rank whose heartbeat did not advance        lost (process or node gone; all ranks of a
                                                     node lost: the node was lost)
      a live rank behind the furthest live rank     did not arrive (named with where it is)
      the store does not answer for T/2             the node hosting it (rank 0's) was lost, or
                                                     the link to it

  The rank prints the verdict and ends: by the collective's own error, or (the watchdog) by
  exiting. A node cut off from the store's node can never rejoin the rendezvous, so it leaves
  the job (``membership.leave_job``), and an elastic job's other nodes re-form without it.

Taken from torch: the process-group timeouts and the rendezvous store (the same TCPStore torch
elastic's agents keep alive through). Written here: the heartbeat, its verdict and the thread
that ends a rank gloo cannot time out. torchft's manager (its quorum and heartbeats to a
lighthouse) and NCCL's flight recorder name the missing rank the same way, by what each rank
last reported, not by the failed collective.
"""

from __future__ import annotations

import json
import os
import queue
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist
from torch.distributed import distributed_c10d

from plait import hookimpl
from plait.config import Range, range_problems
from plait.plugins.fault.config import GUARDED
from plait.plugins.fault.membership import leave_job
from plait.plugins.fault.phases import progress
from plait.types import PluginInfo

RANGES = {"collective_timeout_s": Range(0, low_open=True, meaning="or null: off")}
COLLECTIVE_ERROR = re.compile(r"timed out|timeout|pair closure|connection|peer|socket", re.I)


def set_group_timeouts(timeout: timedelta) -> int:
    """Give every process group this rank belongs to ``timeout``, and make it the default of
    groups created later; the number of groups set."""
    count = 0
    for group in list(distributed_c10d._world.pg_map):
        try:
            distributed_c10d._set_pg_timeout(timeout, group)
            count += 1
        except (ValueError, RuntimeError):  # not a member, or a backend without timeouts
            pass
    distributed_c10d.default_pg_timeout = timeout
    return count


@dataclass
class Verdict:
    """What the heartbeats say when a collective is stuck."""

    host_lost: str | None = None  # the store's address, when it did not answer
    lost: dict[int, list[int]] = field(default_factory=dict)  # node -> its silent ranks
    whole_nodes: list[int] = field(default_factory=list)  # nodes all of whose ranks are silent
    behind: dict[int, str] = field(default_factory=dict)  # rank -> where it is
    ahead: str = ""  # where the furthest live rank is

    @property
    def found(self) -> bool:
        return bool(self.host_lost or self.lost or self.behind)


class StoreCalls:
    """Store calls made on a daemon thread of their own, each waited for at most ``seconds``: a
    call over a link that went silent blocks that thread, never the caller (a TCPStore client's
    own timeout did not bound ``check`` over a cut link: seen blocked for 40 s and more)."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.calls: queue.Queue = queue.Queue()
        self.pending = threading.Event()
        threading.Thread(target=self._serve, name="plait-heartbeat-store", daemon=True).start()

    def _serve(self) -> None:
        while True:
            call, answer, done = self.calls.get()
            try:
                answer.append((True, call()))
            except Exception as error:
                answer.append((False, error))
            self.pending.clear()
            done.set()

    def __call__(self, call):
        """``call()``'s value; ``TimeoutError`` when it (or the one before it) hangs."""
        if self.pending.is_set():
            raise TimeoutError("the previous store call has not returned")
        answer, done = [], threading.Event()
        self.pending.set()
        self.calls.put((call, answer, done))
        if not done.wait(self.seconds):
            raise TimeoutError(f"no answer from the store in {self.seconds:g} s")
        ok, value = answer[0]
        if not ok:
            raise value
        return value


class Heartbeats:
    """This rank's heartbeat in the rendezvous store, and everyone's verdict."""

    def __init__(self, timeout_s: float, rank: int, node_of: list[int]):
        self.timeout_s, self.rank, self.node_of = timeout_s, rank, node_of
        self.interval = min(max(timeout_s / 10, 0.2), 2.0)
        self.address = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            wait_for_workers=False,
            timeout=timedelta(seconds=max(2 * self.interval, 1.0)),
        )
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.store = dist.PrefixStore(f"plait/heartbeat/attempt_{attempt}", store)
        self.calls = StoreCalls(max(2 * self.interval, 1.0))
        self.beat = 0
        self.store_ok_at = time.monotonic()

    def publish(self) -> None:
        self.beat += 1
        record = json.dumps(
            {"beat": self.beat, "position": list(progress.position), "where": progress.describe()}
        )
        key = f"rank{self.rank}"

        def write() -> None:  # TCPStore's set does not wait for an answer; check does
            self.store.set(key, record)
            self.store.check([key])

        try:
            self.calls(write)
            self.store_ok_at = time.monotonic()
        except Exception:  # the store's node unreachable: judged in verdict()
            pass

    def _read(self) -> dict[int, dict] | None:
        keys = [f"rank{r}" for r in range(len(self.node_of))]

        def read() -> dict[int, dict]:
            present = [k for k in keys if self.store.check([k])]
            values = self.store.multi_get(present) if present else []
            return {int(k[4:]): json.loads(v) for k, v in zip(present, values)}

        try:
            found = self.calls(read)
        except Exception:
            return None
        self.store_ok_at = time.monotonic()
        return found

    def verdict(self) -> Verdict:
        first = self._read()
        for _ in range(3):  # beating on, so that the others read this rank as alive
            time.sleep(self.interval)
            self.publish()
        second = self._read()
        if first is None or second is None:
            if time.monotonic() - self.store_ok_at > self.timeout_s / 2:
                return Verdict(host_lost=self.address)
            return Verdict()
        verdict = Verdict()
        alive = {}
        for rank in range(len(self.node_of)):
            before, now = first.get(rank), second.get(rank)
            if rank != self.rank and (
                now is None or before is None or now["beat"] == before["beat"]
            ):
                verdict.lost.setdefault(self.node_of[rank], []).append(rank)
            else:
                alive[rank] = now
        verdict.whole_nodes = [
            n for n, ranks in verdict.lost.items() if len(ranks) == self.node_of.count(n)
        ]
        if second:  # the furthest point any rank reached, lost ones included
            furthest = max(second.values(), key=lambda r: r["position"])
            verdict.ahead = furthest["where"]
            verdict.behind = {
                r: h["where"] for r, h in alive.items() if h["position"] < furthest["position"]
            }
        return verdict

    def describe(self, verdict: Verdict) -> str:
        parts = []
        if verdict.host_lost:
            node = self.node_of[0]
            parts.append(
                f"node {node} was lost, or the link to it: the rendezvous store at "
                f"{verdict.host_lost} (node {node}, rank 0's) has not answered for "
                f"{time.monotonic() - self.store_ok_at:.1f} s"
            )
        for node in verdict.whole_nodes:
            ranks = verdict.lost[node]
            parts.append(
                f"node {node} was lost (rank{'s' * (len(ranks) > 1)} "
                f"{', '.join(map(str, ranks))}: no heartbeat)"
            )
        for node, ranks in verdict.lost.items():
            if node not in verdict.whole_nodes:
                parts += [
                    f"rank {r} (node {node}) was lost (no heartbeat: its process is gone or frozen)"
                    for r in ranks
                ]
        for rank, where in verdict.behind.items():
            who = "this rank" if rank == self.rank else f"rank {rank} (node {self.node_of[rank]})"
            parts.append(
                f"{who} did not arrive: it is alive at {where}, while the furthest "
                f"rank waits at {verdict.ahead}"
            )
        return "; ".join(parts) or "every rank is alive and at the same point"


class Watchdog(threading.Thread):
    """Publishes the heartbeat; ends this rank when its main thread has not moved for T plus
    three heartbeats and the heartbeats say why (someone behind, lost, or the store gone)."""

    def __init__(self, heartbeats: Heartbeats):
        super().__init__(name="plait-watchdog", daemon=True)
        self.heartbeats = heartbeats
        self.stopped = threading.Event()  # no more heartbeats
        self.judged = threading.Event()  # a verdict was given: heartbeats only
        self.deadline = heartbeats.timeout_s + 3 * heartbeats.interval

    def run(self) -> None:
        beats = self.heartbeats
        while not self.stopped.wait(beats.interval):
            beats.publish()
            stuck = time.monotonic() - progress.changed_at
            if self.judged.is_set() or stuck < self.deadline:
                continue
            verdict = beats.verdict()
            if self.judged.is_set() or not verdict.found:
                continue
            self.judged.set()
            print(
                f"plait: rank {beats.rank} (node {beats.node_of[beats.rank]}): no progress for "
                f"{stuck:.1f} s at {progress.describe()} (fault.collective_timeout_s="
                f"{beats.timeout_s:g}): {beats.describe(verdict)}; ending this rank",
                file=sys.stderr,
                flush=True,
            )
            end_rank(verdict, beats)


def end_rank(verdict: Verdict, beats: Heartbeats) -> None:
    """A node cut off from the store's node leaves the job; any other rank exits."""
    if verdict.host_lost:
        leave_job(
            "plait: this node cannot reach the rendezvous host, so it cannot rejoin",
            first_on_node=_first_on_node(),
        )
    os._exit(1)


def _first_on_node() -> bool:
    return os.environ.get("LOCAL_RANK", "0") == "0"


class CollectiveWatchdog:
    def __init__(self) -> None:
        self.watchdog: Watchdog | None = None
        self.timeout_s: float | None = None

    @hookimpl
    def plait_declare(self) -> PluginInfo:
        return PluginInfo(
            name="collective_watchdog",
            selected_by={"fault.name": GUARDED},
            description="fault.collective_timeout_s: every process group's "
            "timeout, and a heartbeat that names who did not arrive",
        )

    @hookimpl
    def plait_validate(self, cfg) -> list[str]:
        return range_problems("fault", cfg.fault, RANGES)

    @hookimpl(wrapper=True)
    def plait_build_engine(self, cfg, topology):
        engine = yield
        self.timeout_s = cfg.fault.collective_timeout_s
        if self.timeout_s is not None and dist.get_world_size() > 1:
            set_group_timeouts(timedelta(seconds=self.timeout_s))
            progress.changed_at = time.monotonic()
            self.watchdog = Watchdog(Heartbeats(self.timeout_s, topology.rank, topology.node_of))
            self.watchdog.heartbeats.publish()
            self.watchdog.start()
        return engine

    @hookimpl
    def plait_on_failure(self, error) -> None:
        """A collective failed (gloo's timeout, a closed connection): say who is to blame."""
        watchdog = self.watchdog
        if watchdog is None or watchdog.judged.is_set():
            return
        watchdog.judged.set()  # it goes on beating: the others read this rank as alive
        if COLLECTIVE_ERROR.search(str(error)):
            beats = watchdog.heartbeats
            verdict = beats.verdict()
            print(
                f"plait: rank {beats.rank} (node {beats.node_of[beats.rank]}): a collective "
                f"failed at {progress.describe()} (fault.collective_timeout_s="
                f"{self.timeout_s:g}): {beats.describe(verdict)}",
                file=sys.stderr,
                flush=True,
            )
            if verdict.host_lost:
                end_rank(verdict, beats)
        watchdog.stopped.set()

    @hookimpl(wrapper=True)
    def plait_save_checkpoint(self, final):
        written = yield
        if final and self.watchdog is not None:
            self.watchdog.stopped.set()
        return written


plugin = CollectiveWatchdog()
