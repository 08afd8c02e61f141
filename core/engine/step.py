"""The base step: one optimizer step's common half, written once for every engine.

Every strategy's step does the same around what is its own::

    set_lr(optimizer, lr)                          # the schedule into the param groups
    for each micro-batch, inside sync(last):       # the strategy's: DDP's no_sync, FSDP's
        loss = loss_fn(model(x), y)                #   set_requires_gradient_sync
        backward(loss / n)                         # the mean loss's gradients, accumulated
    loss = mean of the local losses over dp x cp   # started now, read at the end
    reduce_gradients()                             # the strategy's (experts, dp averages)
    replica groups: average over the quorum        # plait.engine.replicas (fault=torchft):
                                                   #   the gradients and the loss, one buffer
    unscale; norm over the shards; clip            # plait.engine.norm
    guard: plait_check_step(loss, norm)            # every rank, same answer
    replica groups: commit (the group's and the quorum's verdict)
    optimizer_step() unless skipped                # the strategy's
    zero_grad

:class:`TorchEngine` is that step for engines that run a torch optimizer themselves (DDP, FSDP,
local SGD); the functions below are its pieces, for engines that drive the step otherwise (the
pipeline schedule, a parameter-server worker, DeepSpeed's loop).
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Callable, ContextManager

import torch
import torch.distributed as dist

from plait.engine.hyperparameters import set_lr
from plait.engine.norm import ShardGroups, clip_grad_norm_
from plait.engine.precision import autocast, grad_scaler
from plait.engine.replicas import ReplicaGradients
from plait.types import Batch, ReplicaSync, StepOutput, model_inputs


def accumulate(
    micro_batches: list[Batch],
    loss_of: Callable[[Batch], torch.Tensor],
    backward: Callable[[torch.Tensor], None] = torch.Tensor.backward,
    sync: Callable[[bool], ContextManager] | None = None,
) -> torch.Tensor:
    """Backward of each micro-batch's loss divided by their number, so the summed gradients are
    those of the mean loss; ``sync(last)`` is entered around each micro-batch (gradient
    synchronisation on the last one only). Returns this rank's mean loss, detached.

    The sum stays on the loss's device: a host tensor copied there would make the host wait for
    the backward to finish (a blocking copy to a GPU synchronises its stream), and the optimizer's
    launch would no longer overlap the backward."""
    n = len(micro_batches)
    total: torch.Tensor | None = None
    for i, batch in enumerate(micro_batches):
        with sync(i == n - 1) if sync is not None else contextlib.nullcontext():
            loss = loss_of(batch)
            backward(loss / n)
        local = loss.detach().float()
        total = local if total is None else total + local
    assert total is not None, "a step has at least one micro-batch"
    return total / n


def mean_over(
    value: torch.Tensor, group: dist.ProcessGroup | None, size: int
) -> Callable[[], float]:
    """Start averaging ``value`` (in place) over the ``size`` ranks of ``group``; call the result
    to wait for the float. Asynchronous, so the reduction overlaps the optimizer step. (A sum,
    then a division: gloo has no average.)"""
    if size == 1:
        return value.item
    work = dist.all_reduce(value, group=group, async_op=True)

    def wait() -> float:
        work.wait()
        return value.item() / size

    return wait


def ask_guard(
    check_step: Callable[..., list], loss: torch.Tensor, grad_norm: torch.Tensor, loss_scaled: bool
) -> bool:
    """The step guards' answer (``plait_check_step``, agreed over the trainers): True skips the
    step on every rank. Under fp16 (``loss_scaled``) the guards judge the loss alone: a gradient
    overflow is the loss scaler's to skip, routinely in the first steps."""
    judged = torch.zeros_like(grad_norm) if loss_scaled else grad_norm
    return any(check_step(loss=loss, grad_norm=judged))


class TorchEngine:
    """The base step of an engine that steps a torch optimizer itself.

    A strategy subclasses it and supplies only what is its own: the module the forward runs
    (``wrapped``: DDP's wrapper, a compiled model), how micro-batches synchronise (:meth:`sync`),
    what gradients need after backward (:meth:`reduce_gradients`) and how the optimizer steps
    (:meth:`optimizer_step`); the groups its gradients are sharded over (``shard_groups``,
    default: the topology's tp, pp and ep in use). The loss is averaged over ``loss_group``
    (default: the ``dp x cp`` ranks). With ``loss_scaling`` an fp16 run scales the loss with
    torch's dynamic ``GradScaler`` and logs ``loss_scale`` and ``skipped_steps``; without
    ``autocast_forward`` the forward runs as the model's parameters are (FSDP casts per module).
    ``hook``: the run's hook relay, whose ``plait_check_step`` guards each step; None for an
    engine whose replicas step on their own, without a collective per step (local SGD).
    ``replicas``: where the job's replica groups run as independent torch jobs
    (``engine:replica_groups``), the layer that averages over them and commits the step.
    """

    replicas: ReplicaSync | None = None

    def __init__(
        self,
        cfg,
        topology,
        hook,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable,
        *,
        shard_groups: ShardGroups | None = None,
        loss_scaling: bool = True,
        autocast_forward: bool = True,
        loss_group: str = "dp_cp",
    ):
        self.device = topology.device
        self.model = self.wrapped = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.autocast_precision = cfg.precision if autocast_forward else "fp32"
        self.max_norm = cfg.train.grad_clip if cfg.train.grad_clip > 0 else math.inf
        self.check_step: Callable[..., list] = (
            functools.partial(hook.plait_check_step, cfg=cfg, topology=topology)
            if hook is not None
            else lambda **_: []
        )
        self.shard_groups = shard_groups if shard_groups is not None else ShardGroups.of(topology)
        self.loss_group = topology.group(loss_group)
        self.loss_size = dist.get_world_size(self.loss_group)
        self.scaler = grad_scaler(cfg.precision if loss_scaling else "fp32", self.device)
        self.skipped_steps = 0  # steps the fp16 loss scaler skipped on an overflow
        self.replica_gradients = ReplicaGradients()  # used where replica groups run as jobs

    # -- the strategy's own ----------------------------------------------------------------

    def sync(self, last: bool) -> ContextManager:
        """Entered around each micro-batch's forward and backward; ``last``: the step's last."""
        return contextlib.nullcontext()

    def reduce_gradients(self) -> None:
        """What the gradients need after the last backward, before the norm."""

    def optimizer_step(self) -> None:
        self.scaler.step(self.optimizer)  # the optimizer's own step unless fp16

    # -- the common half -------------------------------------------------------------------

    def loss_of(self, batch: Batch) -> torch.Tensor:
        x, kwargs, y = model_inputs(batch, self.device)
        with autocast(self.autocast_precision, self.device):
            return self.loss_fn(self.wrapped(x, **kwargs), y)

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    def train_step(self, micro_batches: list[Batch], lr: float) -> StepOutput:
        set_lr(self.optimizer, lr)
        local_loss = accumulate(micro_batches, self.loss_of, self.backward, self.sync)
        if self.replicas is None:
            loss = mean_over(local_loss.clone(), self.loss_group, self.loss_size)
            grad_norm, skipped, metrics = self.finish_step(local_loss)
        else:  # averaged over the groups with the gradients, then over dp x cp (equal sizes)
            over_groups = local_loss.detach().clone().reshape(1)
            grad_norm, skipped, metrics = self.finish_step(local_loss, over_groups)
            loss = mean_over(over_groups, self.loss_group, self.loss_size)
        return StepOutput(
            loss=float(loss()), grad_norm=float(grad_norm), skipped=skipped, metrics=metrics
        )

    def finish_step(
        self, local_loss: torch.Tensor, *over_groups: torch.Tensor
    ) -> tuple[torch.Tensor, bool, dict]:
        """After the backward: reduce, unscale, clip by the global norm, ask the guard, step.
        ``local_loss``: this rank's mean loss (what the guard judges); ``over_groups``: values
        averaged over the replica groups in the gradients' buffer (the loss). Returns the norm
        before clipping, whether the step was skipped, and the loss scaler's metrics."""
        self.reduce_gradients()
        if self.replicas is not None:
            self.replica_gradients.average(self.replicas, self.model.parameters(), *over_groups)
        self.scaler.unscale_(self.optimizer)
        grad_norm = clip_grad_norm_(self.model.parameters(), self.max_norm, self.shard_groups)
        skipped = ask_guard(self.check_step, local_loss, grad_norm, self.scaler.is_enabled())
        if self.replicas is not None:
            skipped = not self.replicas.commit(not skipped)
        if not skipped:
            self.optimizer_step()
        metrics = self.update_loss_scale() if self.scaler.is_enabled() else {}
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm, skipped, metrics

    def update_loss_scale(self) -> dict[str, float]:
        """fp16: update the scale; it drops exactly when ``scaler.step`` found an inf or NaN
        gradient and skipped the optimizer step (torch's documented way to tell). The same
        metrics as DeepSpeed's scaler under ``strategy=zero*``."""
        before = self.scaler.get_scale()
        self.scaler.update()
        scale = self.scaler.get_scale()
        self.skipped_steps += scale < before
        return {"loss_scale": scale, "skipped_steps": float(self.skipped_steps)}

    @torch.no_grad()
    def eval_loss(self, batch: Batch) -> float:
        self.model.eval()
        loss = self.loss_of(batch).detach().float()
        self.model.train()
        return mean_over(loss, self.loss_group, self.loss_size)()
