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
- ``async``: serve pushes in arrival order (the store's inbox queue). A push computed on version
  ``v`` arrives at version ``V``: staleness ``V - v`` updates. Within ``strategy.max_staleness``
  it is applied (the worker clipped it), beyond it is dropped and the worker gets the fresh
  parameters: a hard bound, which the convergence analyses of bounded-delay asynchronous SGD
  assume; down-weighting would leave old gradients unbounded in number. No worker waits for
  another: each waits only for its own reply.

Every push is logged to ``run.dir/ps_server<s>.jsonl``: the worker, the version it computed on,
the server's version after it, the staleness, and whether it was applied.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist

from plait.plugins.parameter_server.sharding import flat, shards_of, unflatten_into
from plait.plugins.parameter_server.store import inbox, job_store, publish

from plait.plugins.parameter_server import SERVER


class Server:
    def __init__(self, cfg, topology, hook):
        self.cfg = cfg
        self.servers = list(topology.roles.ranks[SERVER])
        self.workers = topology.trainer_ranks
        self.index = self.servers.index(topology.rank)
        model = hook.plait_build_model(cfg=cfg).to(topology.device)
        self.params = shards_of(list(model.parameters()), len(self.servers))[self.index]
        self.optimizer = hook.plait_build_optimizer(cfg=cfg, model=torch.nn.ParameterList(self.params))
        self.max_norm = cfg.train.grad_clip if cfg.train.grad_clip > 0 else math.inf
        self.size = sum(p.numel() for p in self.params)
        self.version = 0
        self.log: list[dict] = []
        self.staleness: dict[str, int] = {}  # applied updates by staleness: the histogram
        self.busy_s = 0.0
        self.started = time.perf_counter()
        self.store = job_store()
        # The servers' own group, for the global gradient norm; only servers create it.
        self.group = (dist.new_group(self.servers, use_local_synchronization=True)
                      if len(self.servers) > 1 else None)

    def message(self, grad_norm: float) -> torch.Tensor:
        return flat(self.params, self.version, grad_norm)

    def apply(self, grad: torch.Tensor, lr: float, clip: bool) -> float:
        """One optimizer step on the shard with the flat gradient ``grad``; the global norm."""
        for p in self.params:
            p.grad = torch.empty_like(p)
        unflatten_into(grad, [p.grad for p in self.params])
        grad_norm = math.nan
        if clip:
            squares = grad.square().sum()
            if self.group is not None:
                dist.all_reduce(squares, group=self.group)
            total = squares.sqrt()
            torch.nn.utils.clip_grads_with_norm_(self.params, self.max_norm, total)
            grad_norm = float(total)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        return grad_norm

    def record(self, worker: int, worker_version: int, applied: bool) -> None:
        staleness = self.version - worker_version - int(applied)
        self.log.append({"t": time.time(), "worker": worker, "worker_version": worker_version,
                         "version": self.version, "staleness": staleness, "applied": applied})
        if applied:
            self.staleness[str(staleness)] = self.staleness.get(str(staleness), 0) + 1

    def serve(self) -> None:
        for worker in self.workers:  # version 0: every worker starts from the servers' weights
            dist.send(self.message(0.0), dst=worker)
        if self.cfg.strategy.mode == "sync":
            self.serve_sync()
        else:
            self.serve_async()
        self.write_log()

    def serve_sync(self) -> None:
        pushes = [torch.empty(self.size + 2) for _ in self.workers]
        for _ in range(self.cfg.train.steps):
            for work in [dist.irecv(buf, src=w) for buf, w in zip(pushes, self.workers)]:
                work.wait()
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

    def serve_async(self) -> None:
        push = torch.empty(self.size + 2)
        bound = self.cfg.strategy.max_staleness
        for _ in range(self.cfg.train.steps * len(self.workers)):
            worker = int(self.store.queue_pop(inbox(self.index)))
            dist.recv(push, src=worker)
            begun = time.perf_counter()
            worker_version, lr = int(push[self.size]), float(push[self.size + 1])
            applied = self.version - worker_version <= bound
            if applied:
                self.apply(push[: self.size], lr, clip=False)  # the worker clipped its own
            self.record(worker, worker_version, applied)
            dist.send(self.message(math.nan), dst=worker)
            self.busy_s += time.perf_counter() - begun
            self.publish()

    def publish(self) -> None:
        """This server's load and staleness histogram, for the logging worker to log."""
        wall = time.perf_counter() - self.started
        publish(self.store, f"server{self.index}", {
            "version": self.version, "dropped": sum(not e["applied"] for e in self.log),
            "busy_fraction": self.busy_s / wall, "updates_per_s": self.version / wall,
            "staleness": self.staleness})

    def write_log(self) -> None:
        path = Path(self.cfg.run.dir) / f"ps_server{self.index}.jsonl"
        path.write_text("".join(json.dumps(entry) + "\n" for entry in self.log))
