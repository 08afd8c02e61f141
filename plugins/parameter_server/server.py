"""A parameter server's loop: hold one shard of the parameters, apply the optimizer to it.

Each server builds the model exactly as the trainers do (same seed), keeps the tensors its shard
owns (:mod:`.sharding`) and builds the run's optimizer over them only. Workers push gradients
(point to point, one fp32 message per shard: the gradients, then the version they were computed
on and the learning rate) and receive the shard's parameters back, then the version and the
global gradient norm.

- ``sync``: each step, wait for every worker's push, average (worker order, so every run sums
  alike), clip by the global norm (squared norms summed over the servers), step, reply to all.
  That is 1 process on the global batch: the mean of the workers' mean gradients is the global
  batch's mean gradient.
- ``async``: serve pushes in arrival order. A push computed on version
  ``v`` arrives at version ``V``: staleness ``V - v`` updates. Within ``strategy.max_staleness``
  it is applied (the worker clipped it), beyond it is dropped and the worker gets the fresh
  parameters: a hard bound, which the convergence analyses of bounded-delay asynchronous SGD
  assume; down-weighting would leave old gradients unbounded in number. No worker waits for
  another: each waits only for its own reply.

Every push is logged to ``run.dir/ps_server<s>.jsonl``: the worker, the version it computed on,
the server's version after it, the staleness, and whether it was applied.

A lost worker (``async``): each server posts a receive from every worker on the goodbye tag
(:data:`BYE`) and a thread per worker waits for it. A worker sends its goodbye after its last
step; a worker that dies has its connections closed by the kernel, and gloo fails that receive
at once (as it fails any transfer with the dead process). The thread puts ``bye <worker>`` or
``lost <worker> <error>`` in the server's inbox, through a store connection of its own. The
failed goodbye is how a server notices the loss: no heartbeat period to tune, no false alarm for
a worker that is merely slow; a push or reply that fails midway counts the same. The server then
stops waiting for that worker, logs it (a line with ``"left"`` in the log, a message on stderr,
``workers_alive`` in the published figures) and serves the others. In ``sync`` mode every step
needs every worker: a lost worker is a failure of the job, for the launcher's restart.

A server reads its work from its inbox, a queue in the job's store (:mod:`.store`), in order:
``grad <worker>`` (a push is on its way), ``checkpoint <step> <directory>`` (the first worker saves
a checkpoint: write this shard, its optimizer state, version and log into ``directory``, then say
so in the store), ``bye <worker>`` / ``lost <worker> <error>`` (async: that worker's goodbye arrived / failed) and
``end`` (the first worker's run ended). It stops once the end is announced and every worker is done (sync: every
round of the run served; async: every worker said goodbye or was lost): a final checkpoint may
follow the last step. On start it
loads its shard from the checkpoint the run resumes from (``plait_find_checkpoint``: the same
one the workers load), so a resumed run continues with the servers' exact state.
"""

from __future__ import annotations

import json
import math
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from plait.config import job_last_step
from plait.engine import norm
from plait.engine.hyperparameters import set_lr
from plait.plugins.parameter_server import SERVER
from plait.plugins.parameter_server.sharding import flat, shards_of, unflatten_into
from plait.plugins.parameter_server.store import inbox, job_store, publish, saved_key

BYE = 1  # the tag of a worker's goodbye (pushes and replies travel on tag 0)
WHOLE_RUN = timedelta(days=365)  # how long a goodbye may take: the worker's whole run


class Server:
    def __init__(self, cfg, topology, hook):
        self.cfg = cfg
        self.servers = list(topology.roles.ranks[SERVER])
        self.workers = topology.trainer_ranks
        self.index = self.servers.index(topology.rank)
        model = hook.plait_build_model(cfg=cfg).to(topology.device)
        self.params = shards_of(list(model.parameters()), len(self.servers))[self.index]
        self.optimizer = hook.plait_build_optimizer(
            cfg=cfg, model=torch.nn.ParameterList(self.params)
        )
        self.max_norm = cfg.train.grad_clip if cfg.train.grad_clip > 0 else math.inf
        self.size = sum(p.numel() for p in self.params)
        self.version = 0
        self.log: list[dict] = []
        self.staleness: dict[str, int] = {}  # applied updates by staleness: the histogram
        self.step = 0  # the workers' step this state belongs to (the last checkpoint's, or 0)
        self.busy_s = 0.0
        self.started = time.perf_counter()
        self.store = job_store()
        self.inbox = inbox(self.index)
        self.alive = set(self.workers)
        self.group = topology.role_group(SERVER)  # the servers', for the global gradient norm
        self.checkpoint_name = f"ps_server{self.index}.pt"
        resume_from = hook.plait_find_checkpoint(cfg=cfg, path=cfg.resume)
        if resume_from is not None:
            self.load(Path(resume_from))

    def save(self, directory: Path, step: int) -> None:
        torch.save(
            {
                "params": [p.detach() for p in self.params],
                "optimizer": self.optimizer.state_dict(),
                "version": self.version,
                "step": step,
                "log": self.log,
                "staleness": self.staleness,
            },
            directory / self.checkpoint_name,
        )

    def load(self, directory: Path) -> None:
        state = torch.load(
            directory / self.checkpoint_name, map_location=self.params[0].device, weights_only=True
        )
        with torch.no_grad():
            for p, saved in zip(self.params, state["params"], strict=True):
                p.copy_(saved)
        self.optimizer.load_state_dict(state["optimizer"])
        self.version, self.step = state["version"], state["step"]
        self.log, self.staleness = state["log"], state["staleness"]

    def message(self, grad_norm: float) -> torch.Tensor:
        return flat(self.params, self.version, grad_norm)

    def apply(self, grad: torch.Tensor, lr: float, clip: bool) -> float:
        """One optimizer step on the shard with the flat gradient ``grad``; the global norm."""
        for p in self.params:
            p.grad = torch.empty_like(p)
        unflatten_into(grad, [p.grad for p in self.params])
        grad_norm = math.nan
        if clip:  # the servers hold disjoint shards: their squares add up over the servers
            total = norm.grad_norm(self.params, norm.ShardGroups(shard=self.group))
            norm.clip_grads_(self.params, self.max_norm, total)
            grad_norm = float(total)
        set_lr(self.optimizer, lr)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        return grad_norm

    def record(self, worker: int, worker_version: int, applied: bool) -> None:
        staleness = self.version - worker_version - int(applied)
        self.log.append(
            {
                "t": time.time(),
                "worker": worker,
                "worker_version": worker_version,
                "version": self.version,
                "staleness": staleness,
                "applied": applied,
            }
        )
        if applied:
            self.staleness[str(staleness)] = self.staleness.get(str(staleness), 0) + 1

    def serve(self) -> None:
        if self.cfg.strategy.mode == "sync":
            # from the checkpoint on, to the end of this job (train.stop_at: one PBT round)
            rounds = SyncRounds(self, job_last_step(self.cfg.train) - self.step)
        else:
            rounds = AsyncPushes(self)
            self.await_goodbyes()
        for worker in self.workers:  # every worker starts from the servers' weights
            self.send(self.message(0.0), worker)
        ended = False
        while not (ended and rounds.done):
            kind, _, detail = self.store.queue_pop(self.inbox).decode().partition(" ")
            if kind == "grad":
                rounds.receive(int(detail))
            elif kind == "bye":
                rounds.finished.add(int(detail))
            elif kind == "lost":
                worker, _, error = detail.partition(" ")
                self.lose(int(worker), RuntimeError(error))
            elif kind == "checkpoint":
                step, _, directory = detail.partition(" ")
                self.save(Path(directory), int(step))
                self.store.set(saved_key(int(step), self.index), directory)
            else:  # "end"
                ended = True
        self.write_log()

    def await_goodbyes(self) -> None:
        """async: post a receive of every worker's goodbye; a thread per worker waits for it
        and says in the inbox whether it came (``bye``) or failed (``lost``: the worker died)."""
        store = job_store(own_connection=True)

        def await_goodbye(worker: int, goodbye: dist.Work) -> None:
            try:
                goodbye.wait(WHOLE_RUN)
                store.queue_push(self.inbox, f"bye {worker}")
            except RuntimeError as error:
                store.queue_push(self.inbox, f"lost {worker} {first_line(error)}")

        for worker in self.workers:
            goodbye = dist.irecv(torch.empty(1), src=worker, tag=BYE)
            threading.Thread(
                target=await_goodbye, args=(worker, goodbye), daemon=True, name=f"goodbye-{worker}"
            ).start()

    def lose(self, worker: int, error: Exception) -> None:
        """Stop waiting for ``worker``: logged, printed, published (async only)."""
        if self.cfg.strategy.mode == "sync":
            raise error  # every step needs every worker: a failure for the launcher's restart
        if worker not in self.alive:
            return
        self.alive.discard(worker)
        why = first_line(error)
        self.log.append(
            {
                "t": time.time(),
                "worker": worker,
                "left": why,
                "version": self.version,
                "alive": len(self.alive),
            }
        )
        print(
            f"plait: parameter server {self.index}: worker rank {worker} lost at version "
            f"{self.version} ({why}); {len(self.alive)} of {len(self.workers)} workers go on",
            file=sys.stderr,
            flush=True,
        )
        self.publish()

    def send(self, message: torch.Tensor, worker: int) -> None:
        """Send to ``worker``; in async mode a failed send means the worker is lost."""
        try:
            dist.send(message, dst=worker)
        except RuntimeError as error:
            self.lose(worker, error)

    def receive(self, buffer: torch.Tensor, worker: int) -> bool:
        """Receive from ``worker``; False when it was lost on the way (async)."""
        try:
            dist.recv(buffer, src=worker)
            return True
        except RuntimeError as error:
            self.lose(worker, error)
            return False

    def serve_round(self, pushes: list[torch.Tensor]) -> None:
        """sync: one step with every worker's push (``pushes`` in worker order)."""
        begun = time.perf_counter()
        grad = torch.stack([buf[: self.size] for buf in pushes]).sum(0) / len(self.workers)
        worker_version, lr = int(pushes[0][self.size]), float(pushes[0][self.size + 1])
        grad_norm = self.apply(grad, lr, clip=True)
        for w in self.workers:
            self.record(w, worker_version, applied=True)
        reply = self.message(grad_norm)
        for work in [dist.isend(reply, dst=w) for w in self.workers]:
            work.wait()
        self.busy_s += time.perf_counter() - begun
        self.publish()

    def serve_push(self, worker: int, push: torch.Tensor) -> None:
        """async: one worker's push on its own, applied within the staleness bound."""
        begun = time.perf_counter()
        worker_version, lr = int(push[self.size]), float(push[self.size + 1])
        applied = self.version - worker_version <= self.cfg.strategy.max_staleness
        if applied:
            self.apply(push[: self.size], lr, clip=False)  # the worker clipped its own
        self.record(worker, worker_version, applied)
        self.send(self.message(math.nan), worker)
        self.busy_s += time.perf_counter() - begun
        self.publish()

    def publish(self) -> None:
        """This server's load and staleness histogram, for the logging worker to log."""
        wall = time.perf_counter() - self.started
        publish(
            self.store,
            f"server{self.index}",
            {
                "version": self.version,
                "dropped": sum(e.get("applied") is False for e in self.log),
                "busy_fraction": self.busy_s / wall,
                "updates_per_s": self.version / wall,
                "workers_alive": len(self.alive),
                "staleness": self.staleness,
            },
        )

    def write_log(self) -> None:
        path = Path(self.cfg.run.dir) / f"ps_server{self.index}.jsonl"
        path.write_text("".join(json.dumps(entry) + "\n" for entry in self.log))


def first_line(error: Exception) -> str:
    return (str(error).splitlines() or [""])[0][:200]


class SyncRounds:
    """sync: collect one push from every worker, then serve the round; ``rounds`` of them."""

    def __init__(self, server: Server, rounds: int):
        self.server, self.left = server, rounds
        self.pushes = {w: torch.empty(server.size + 2) for w in server.workers}
        self.arrived: set[int] = set()

    @property
    def done(self) -> bool:
        return self.left == 0

    def receive(self, worker: int) -> None:
        self.server.receive(self.pushes[worker], worker)  # a failure raises (sync)
        self.arrived.add(worker)
        if len(self.arrived) == len(self.pushes):
            self.server.serve_round([self.pushes[w] for w in self.server.workers])
            self.arrived.clear()
            self.left -= 1


class AsyncPushes:
    """async: serve each push as it arrives, until every worker said goodbye or was lost."""

    def __init__(self, server: Server):
        self.server = server
        self.push = torch.empty(server.size + 2)
        self.finished: set[int] = set()  # said goodbye (after their last push was served)

    @property
    def done(self) -> bool:
        return self.server.alive <= self.finished

    def receive(self, worker: int) -> None:
        if worker in self.server.alive and self.server.receive(self.push, worker):
            self.server.serve_push(worker, self.push)
