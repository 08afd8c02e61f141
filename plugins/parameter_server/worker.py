"""The trainers' engine under ``strategy=parameter_server``: pull the parameters, compute the
gradient of this worker's share of the batch, push it to the servers, take their reply.

The replies' receives are posted before the gradients go out, so a server's answer never waits
for its worker. Each push is announced in the server's inbox queue. In ``async`` mode each worker
clips its own gradient (each push is one update), and after its last step says goodbye to every
server (a message on the goodbye tag): a server whose posted receive of it fails instead knows
the worker died (``server.py``). In ``sync`` mode the servers clip
the averaged gradient and the loss is averaged over the workers.

Checkpoints: the first worker writes the model it last pulled (for ``plait export``) and its step
count, and asks every server to write its shard, optimizer state and version into the same
checkpoint directory, waiting for their answers before the checkpoint is completed. Every worker
takes its step count back on resume; the parameters come from the servers, which resume from the
same checkpoint.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
import torch.distributed as dist

from plait.config import job_last_step
from plait.engine.norm import clip_grad_norm_
from plait.engine.precision import autocast
from plait.engine.step import accumulate, mean_over
from plait.plugins.parameter_server import SERVER
from plait.plugins.parameter_server.server import BYE
from plait.plugins.parameter_server.sharding import flat, shards_of, unflatten_into
from plait.plugins.parameter_server.store import inbox, job_store, publish, read_figures, saved_key
from plait.types import Batch, StepOutput, model_inputs


class WorkerEngine:
    def __init__(self, cfg, model, loss_fn, topology):
        self.device = topology.device
        self.model = model.to(self.device)
        self.loss_fn = loss_fn
        self.precision = cfg.precision
        self.sync = cfg.strategy.mode == "sync"
        self.max_norm = cfg.train.grad_clip if cfg.train.grad_clip > 0 else math.inf
        self.servers = list(topology.roles.ranks[SERVER])
        self.shards = shards_of(list(self.model.parameters()), len(self.servers))
        self.rank, self.workers = topology.rank, topology.trainer_ranks
        self.step_group = topology.step_group  # None: this worker alone
        self.step_size = dist.get_world_size(self.step_group) if self.step_group else 1
        self.samples_per_step = cfg.train.batch_size // topology.dims.dp
        self.last_step = job_last_step(cfg.train)
        self.log_every = cfg.train.log_every
        self.saves_checkpoint = topology.is_logging_rank
        self.store = job_store()
        self.steps, self.started = 0, time.perf_counter()
        self.first_step = 0  # the step this process started at (a resumed run's checkpoint)
        # figures from the start: a straggler yet to finish its first step reads as 0 steps
        publish(self.store, f"worker{self.rank}", {"steps": 0, "samples_per_s": 0.0})
        self.replies = [flat(shard, 0, 0) for shard in self.shards]
        self.versions = [0] * len(self.servers)
        self.grad_norm = self._receive(
            [dist.irecv(r, src=s) for r, s in zip(self.replies, self.servers)]
        )

    def _receive(self, works) -> float:
        """Wait for the servers' replies, load them into the model; the reported grad norm."""
        for work in works:
            work.wait()
        with torch.no_grad():
            for i, (reply, shard) in enumerate(zip(self.replies, self.shards)):
                version, grad_norm = unflatten_into(reply, shard)
                self.versions[i] = int(version)
        return grad_norm

    def _loss(self, batch: Batch) -> torch.Tensor:
        x, kwargs, y = model_inputs(batch, self.device)
        with autocast(self.precision, self.device):
            return self.loss_fn(self.model(x, **kwargs), y)

    def train_step(self, micro_batches: list[Batch], lr: float) -> StepOutput:
        mean = accumulate(micro_batches, self._loss)
        own_norm = None
        if not self.sync:  # each push is an update of its own: clip it here
            own_norm = float(clip_grad_norm_(self.model.parameters(), self.max_norm))
        replies = [dist.irecv(r, src=s) for r, s in zip(self.replies, self.servers)]
        pushes = []
        for i, (shard, server) in enumerate(zip(self.shards, self.servers)):
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in shard]
            pushes.append(dist.isend(flat(grads, self.versions[i], lr), dst=server))
            self.store.queue_push(inbox(i), f"grad {self.rank}")
        for work in pushes:
            work.wait()
        server_norm = self._receive(replies)
        self.model.zero_grad(set_to_none=True)
        self.steps += 1
        if not self.sync and self.steps == self.last_step:
            self._say_goodbye()
        mean_loss = mean_over(mean, self.step_group, self.step_size)()
        return StepOutput(
            loss=mean_loss,
            grad_norm=own_norm if own_norm is not None else server_norm,
            metrics=self._figures(),
        )

    def _say_goodbye(self) -> None:
        """async: this worker's pushes are over (its last one was served)."""
        for server in self.servers:
            dist.send(torch.zeros(1), dst=server, tag=BYE)

    def _figures(self) -> dict[str, float]:
        """Publish this worker's throughput; on the logging rank's logged steps, gather every
        worker's and server's figures (W&B: worker throughput, staleness histogram, load)."""
        wall = time.perf_counter() - self.started
        samples = (self.steps - self.first_step) * self.samples_per_step
        publish(
            self.store, f"worker{self.rank}", {"steps": self.steps, "samples_per_s": samples / wall}
        )
        if not self.saves_checkpoint or self.steps % self.log_every:
            return {}
        names = [f"worker{w}" for w in self.workers] + [
            f"server{s}" for s in range(len(self.servers))
        ]
        metrics = {}
        for name, figures in read_figures(self.store, names).items():
            for key, value in figures.items():
                if key == "staleness":
                    for age, count in value.items():
                        metrics[f"ps/staleness/{age}"] = (
                            metrics.get(f"ps/staleness/{age}", 0) + count
                        )
                else:
                    metrics[f"ps/{name}/{key}"] = float(value)
        return metrics

    @torch.no_grad()
    def eval_loss(self, batch: Batch) -> float:
        self.model.eval()
        loss = self._loss(batch).detach().float()
        self.model.train()
        return mean_over(loss, self.step_group, self.step_size)()

    def save_state(self, directory: Path) -> None:
        """The model as this worker last pulled it (in sync mode, the servers' parameters after
        the step) and the step count; every server writes its shard beside them."""
        if not self.saves_checkpoint:
            return
        torch.save(
            {"model": self.model.state_dict(), "steps": self.steps}, directory / "model_pp0_tp0.pt"
        )
        for i in range(len(self.servers)):
            self.store.queue_push(inbox(i), f"checkpoint {self.steps} {directory}")
        self.store.wait([saved_key(self.steps, i) for i in range(len(self.servers))])

    def load_state(self, directory: Path) -> None:
        """The step count; the parameters came from the servers, resumed from ``directory``."""
        state = torch.load(directory / "model_pp0_tp0.pt", weights_only=True)
        self.steps = self.first_step = state["steps"]
