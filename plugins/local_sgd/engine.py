"""Replicas that step on their own and meet every H steps: local SGD's engine, and DiLoCo's base.

Each data-parallel rank holds a full replica and runs the run's optimizer on its own gradients
(no gradient communication). Local SGD wraps that optimizer in torch's
``PostLocalSGDOptimizer`` with a ``PeriodicModelAverager`` over the data-parallel group, which
averages the parameters after every H-th step. torch's averager averages when its count (from 0)
minus ``warmup_steps`` is a multiple of the period; a warm-up of H-1 makes that after steps
H, 2H, ... (this engine runs no DDP, so nothing else happens during that "warm-up").

With ``strategy.node_sync_every=K`` the averager is torch's ``HierarchicalModelAverager``
instead: the replicas on each node are averaged every K steps and all replicas every H steps
(at a step that is a multiple of both, only the wider average runs: it includes the narrower).
It splits the data-parallel group into consecutive blocks of one node's size, so every node must
hold the same number of replicas, in rank order (what the launcher gives); its count starts at 1
so that it averages after steps K, 2K, ... and H, 2H, ...

Figures: the loss is the mean over replicas on averaging steps and this replica's own in between,
and the grad norm is this replica's own, so no collective runs between averagings. Gradient
clipping clips each replica's own gradient. Checkpoints hold every replica
(``replica_dp<r>.pt``), so a resumed run continues each replica where it was.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.distributed.algorithms.model_averaging.hierarchical_model_averager import (
    HierarchicalModelAverager,
)
from torch.distributed.optim import PostLocalSGDOptimizer

from plait.engine.hyperparameters import set_lr
from plait.engine.step import TorchEngine, accumulate, mean_over
from plait.topology import split_by_node
from plait.types import Batch, StepOutput


class LocalSGDEngine(TorchEngine):
    """The base step (:class:`plait.engine.step.TorchEngine`) of each replica on its own: no
    gradient reduction, no step guard (it would be a collective every step), the optimizer
    wrapped in torch's model averager."""

    def __init__(self, cfg, model, optimizer, loss_fn, topology):
        super().__init__(
            cfg,
            topology,
            None,
            model.to(topology.device),
            optimizer,
            loss_fn,
            loss_scaling=False,
            loss_group="dp",
        )
        self.dp_group = self.loss_group
        self.checkpoint_name = f"replica_dp{topology.dp_rank}.pt"
        self.sync_every = cfg.strategy.sync_every
        self.steps = 0
        self.node_of = topology.node_of
        self.optimizer = self.wrap(optimizer, cfg)

    def wrap(self, optimizer: torch.optim.Optimizer, cfg) -> torch.optim.Optimizer:
        if cfg.strategy.node_sync_every:
            averager = self.hierarchical_averager(cfg.strategy.node_sync_every)
        else:
            averager = PeriodicModelAverager(
                period=self.sync_every,
                warmup_steps=self.sync_every - 1,
                process_group=self.dp_group,
            )
        return PostLocalSGDOptimizer(optimizer, averager)

    def hierarchical_averager(self, node_sync_every: int) -> HierarchicalModelAverager:
        ranks = dist.get_process_group_ranks(self.dp_group)
        nodes = split_by_node(ranks, self.node_of)
        size = len(nodes[0]) if nodes else 0
        if nodes is None or nodes != [ranks[i : i + size] for i in range(0, len(ranks), size)]:
            raise ValueError(
                f"strategy.node_sync_every={node_sync_every} averages the replicas of each node, "
                f"but the nodes hold unequal or interleaved shares of them ({nodes or ranks}): "
                "launch the same launcher.nproc_per_node on every node, or set "
                "strategy.node_sync_every=0"
            )
        averager = HierarchicalModelAverager(
            OrderedDict([(node_sync_every, size), (self.sync_every, len(ranks))]),
            process_group=self.dp_group,
        )
        averager.step = 1  # the step just taken when it is called (see the module docstring)
        return averager

    def optimizer_step(self) -> None:
        self.optimizer.step()  # PostLocalSGDOptimizer: the local step, then the averager

    @property
    def averaged(self) -> bool:
        """The replicas were averaged after the step just taken."""
        return self.steps % self.sync_every == 0

    def train_step(self, micro_batches: list[Batch], lr: float) -> StepOutput:
        set_lr(self.optimizer, lr)
        local_loss = accumulate(micro_batches, self.loss_of)
        self.steps += 1
        grad_norm, _, _ = self.finish_step(local_loss)
        loss = (
            mean_over(local_loss, self.dp_group, self.loss_size)()
            if self.averaged
            else float(local_loss)
        )
        return StepOutput(
            loss=loss,
            grad_norm=float(grad_norm),
            metrics={"replicas_averaged": float(self.averaged)},
        )

    def state(self) -> dict:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "steps": self.steps,
        }

    def load(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        # torch's Optimizer.load_state_dict replaces its param_groups list, while
        # PostLocalSGDOptimizer keeps the list it took when built: the learning rate set on it
        # each step would never reach the optimizer again (a resumed run kept the lr it resumed
        # with). Point it at the loaded groups.
        self.optimizer.param_groups = getattr(self.optimizer, "optim", self.optimizer).param_groups
        self.steps = state["steps"]

    def save_state(self, directory: Path) -> None:
        torch.save(self.state(), directory / self.checkpoint_name)

    def load_state(self, directory: Path) -> None:
        self.load(
            torch.load(
                directory / self.checkpoint_name, map_location=self.device, weights_only=True
            )
        )
