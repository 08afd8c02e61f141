"""The pipeline engine: one optimizer step as a schedule over the step's micro-batches, around
the strategy's engine (which keeps the optimizer and the checkpoint files)."""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from plait.engine.buckets import average_gradients
from plait.engine.experts import average_expert_gradients, is_expert
from plait.engine.hyperparameters import set_lr
from plait.engine.norm import ShardGroups, clip_grad_norm_
from plait.engine.precision import autocast
from plait.engine.replicas import ReplicaGradients, average_value
from plait.engine.stages import PipelineStageModules
from plait.engine.step import ask_guard
from plait.plugins.pipeline.schedules import SCHEDULES, make_schedule, stage_to_rank
from plait.types import Batch, PipelineDrivenEngine, ReplicaSync, StepOutput, model_inputs

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64]
MAX_DIMS = 6


def send_tensor(tensor: torch.Tensor, dst: int) -> None:
    """Send a tensor of any shape and dtype: a fixed-size header, then the data."""
    dtype_code = DTYPES.index(tensor.dtype)
    header = torch.tensor(
        [tensor.dim(), dtype_code, *tensor.shape] + [0] * (MAX_DIMS - tensor.dim()),
        dtype=torch.int64,
    )
    dist.send(header.to(tensor.device), dst)
    dist.send(tensor.contiguous(), dst)


def recv_tensor(src: int, device: torch.device) -> torch.Tensor:
    header = torch.empty(2 + MAX_DIMS, dtype=torch.int64, device=device)
    dist.recv(header, src)
    ndim, dtype_code, *shape = header.tolist()
    tensor = torch.empty(shape[:ndim], dtype=DTYPES[dtype_code], device=device)
    dist.recv(tensor, src)
    return tensor


class PipelineEngine:
    """Runs one optimizer step as a pipeline schedule over the step's micro-batches.

    Reuses the strategy engine's optimizer and checkpoint files; the loss is computed on the
    last stage and summed over the pipeline group (zero elsewhere), so every rank, rank 0
    included, returns the global mean. After the schedule's backward, a strategy engine that
    steps itself (``engine:pipeline_step``, :class:`plait.types.SelfSteppingEngine`; ZeRO-1:
    DeepSpeed averages into its partitions, clips and steps) finishes the step; otherwise
    (:class:`plait.types.LossScaledEngine`) this engine does, with the comm plugin's reducer. The gradient
    norm is the global one, ``sqrt(sum over stages (and tp shards) of |g|^2)``, and clipping
    scales every stage by the same factor.

    fp16: the schedule differentiates the loss its ``loss_fn`` returns, so the strategy engine's
    ``GradScaler`` scales it there, and the gradients are unscaled after the dp average. An
    overflow on any stage makes the global norm non-finite, so every rank sees it at once: the
    step is skipped everywhere and the scale backs off (given explicitly: the scaler's own
    found-inf is per rank, and another stage's overflow is not in it).

    Expert parallelism: experts' gradients are averaged over the expert-data-parallel group
    instead of dp, and their norm summed over the expert-parallel group.
    """

    # torch's schedules backpropagate each micro-batch's loss unscaled, then scale every
    # gradient by 1/m (scale_grads): what a mixture of experts' auxiliary losses must know
    scales_grads_after_backward = True

    def __init__(
        self,
        cfg,
        inner: PipelineDrivenEngine,
        loss_fn,
        grad_reducer,
        topology,
        hook,
        inner_steps: bool,
    ):
        """``inner_steps``: the strategy declared ``engine:pipeline_step`` (its engine is a
        :class:`SelfSteppingEngine`); else ``inner`` is a :class:`LossScaledEngine`."""
        from torch.distributed import pipelining

        self.inner = inner
        self.inner_steps = inner_steps
        self._replicas: ReplicaSync | None = None
        self.replica_gradients = ReplicaGradients()  # used where replica groups run as jobs
        self.check_step = functools.partial(hook.plait_check_step, cfg=cfg, topology=topology)
        self.model: PipelineStageModules = inner.model
        self.optimizer = inner.optimizer
        self.device = topology.device
        self.precision = cfg.precision
        self.max_norm = cfg.train.grad_clip if cfg.train.grad_clip > 0 else math.inf
        self.pp_group = topology.group("pp")
        # gradients and the loss are averaged over the data- and context-parallel ranks
        self.dp_group = topology.group("dp_cp")
        self.dp_size = topology.dims.dp_cp
        self.grad_reducer = grad_reducer  # the comm plugin's: averages each bucket over dp x cp
        self.shard_groups = ShardGroups.of(topology)  # tp, pp (this engine's), ep
        self.ep = topology.dims.ep
        self.edp_group = topology.group("edp")
        n_stages = self.model.n_stages
        self.stages = [
            pipelining.PipelineStage(chunk, index, n_stages, self.device, group=self.pp_group)
            for index, chunk in self.model.chunks
        ]
        self.chunks = dict(self.model.chunks)
        self.n_stages, self.loss_fn = n_stages, loss_fn
        self.placement = stage_to_rank(
            topology.dims.pp, n_stages, SCHEDULES[cfg.pipeline.schedule][2]
        )
        self.pp_rank = topology.pp_rank
        self.has_first, self.has_last = 0 in self.chunks, n_stages - 1 in self.chunks
        scaler = None if inner_steps else inner.scaler
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        if self.scaler:  # a stage without the loss never scales one: make the scale exist
            self.scaler.scale(torch.ones((), device=self.device))
        self.schedule = make_schedule(
            cfg.pipeline.schedule,
            self.stages,
            cfg.pipeline.microbatches,
            self._scaled(loss_fn) if self.scaler else loss_fn,
        )

    def _scaled(self, loss_fn):
        def scaled_loss(output, target):
            return self.scaler.scale(loss_fn(output, target))

        return scaled_loss

    def _reduce_loss(self, loss: torch.Tensor) -> float:
        """The last stage's loss (zero on the others) to every rank, averaged over dp x cp."""
        return self._start_loss_reduction(loss)()

    def _start_loss_reduction(self, loss: torch.Tensor) -> Callable[[], float]:
        """Start :meth:`_reduce_loss`; call the result for the float. The sum over the stages
        runs while the step goes on (as the base step's ``mean_over``): not one more point
        where every stage waits for the others."""
        loss = loss.detach().to(self.device, torch.float32)
        work = dist.all_reduce(loss, group=self.pp_group, async_op=True)

        def wait() -> float:
            work.wait()
            if self.dp_size > 1:
                dist.all_reduce(loss, group=self.dp_group)
                return (loss / self.dp_size).item()
            return loss.item()

        return wait

    def train_step(self, micro_batches: list[Batch], lr: float) -> StepOutput:
        set_lr(self.optimizer, lr)
        # each (pinned) micro-batch copied without blocking, joined on the device; packed
        # documents' position_ids go to every stage (each masks its attention by them)
        x, y, *positions = (
            torch.cat([b[i].to(self.device, non_blocking=True) for b in micro_batches])
            for i in range(len(micro_batches[0]))
        )
        kwargs = {"position_ids": positions[0]} if positions else {}
        losses: list[torch.Tensor] = []
        scale = self.scaler.get_scale() if self.scaler else 1.0
        with autocast(self.precision, self.device):
            self.schedule.step(
                *((x,) if self.has_first else ()),
                target=y,
                losses=losses,
                return_outputs=False,
                **kwargs,
            )
        local_loss = torch.stack(losses).mean() / scale if self.has_last else torch.zeros(())
        reduced_loss = self._start_loss_reduction(local_loss.clone())  # read after the step
        if self.inner_steps:  # the strategy reduces and steps (ZeRO, FSDP)
            loss = average_value(self.replicas, reduced_loss(), self.device)
            return self.inner.step_after_backward(loss, local_loss.detach())
        if self.dp_size > 1:
            dense = [p for p in self.model.parameters() if not is_expert(p)]
            average_gradients(dense, self.grad_reducer, self.dp_group)
            if self.ep > 1:
                average_expert_gradients(self.model.parameters(), self.edp_group, self.dp_size)
        if self.replicas is not None:  # the loss averaged over the groups with the gradients
            over_groups = torch.tensor([reduced_loss()], dtype=torch.float32, device=self.device)
            self.replica_gradients.average(self.replicas, self.model.parameters(), over_groups)
            reduced_loss = functools.partial(float, over_groups)
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        grad_norm = clip_grad_norm_(self.model.parameters(), self.max_norm, self.shard_groups)
        overflow = self.scaler is not None and not bool(torch.isfinite(grad_norm))
        # fp16: an overflow is the scaler's to skip (as under DDP); the guard judges the loss
        skipped = ask_guard(
            self.check_step, local_loss.detach(), grad_norm, self.scaler is not None
        )
        if self.replicas is not None:
            skipped = not self.replicas.commit(not skipped)
        if not (skipped or overflow):
            self.optimizer.step()
        metrics = self._update_loss_scale(scale, overflow) if self.scaler else {}
        self.optimizer.zero_grad(set_to_none=True)
        return StepOutput(
            loss=reduced_loss(), grad_norm=grad_norm.item(), skipped=skipped, metrics=metrics
        )

    def _update_loss_scale(self, scale: float, overflow: bool) -> dict[str, float]:
        """The same metrics as the DDP engine's; its ``skipped_steps`` is checkpointed."""
        if overflow:
            self.scaler.update(scale * self.scaler.get_backoff_factor())
            self.inner.skipped_steps += 1
        else:
            self.scaler.update()
        return {
            "loss_scale": self.scaler.get_scale(),
            "skipped_steps": float(self.inner.skipped_steps),
        }

    @torch.no_grad()
    def eval_loss(self, batch: Batch) -> float:
        """Forward only, the whole batch at once, stage after stage over point-to-point sends
        (the same for every schedule; torch's ``schedule.eval`` fails for ZBV in torch 2.13)."""
        self.model.eval()
        x, kwargs, y = model_inputs(batch, self.device)
        hidden, loss = x, torch.zeros((), device=self.device)
        with autocast(self.precision, self.device):
            for index in range(self.n_stages):
                if self.placement[index] != self.pp_rank:
                    continue
                if index > 0 and self.placement[index - 1] != self.pp_rank:
                    hidden = recv_tensor(self._peer(self.placement[index - 1]), self.device)
                hidden = self.chunks[index](hidden, **kwargs)
                if index == self.n_stages - 1:
                    loss = self.loss_fn(hidden, y).detach().float()
                elif self.placement[index + 1] != self.pp_rank:
                    send_tensor(hidden, self._peer(self.placement[index + 1]))
        self.model.train()
        return self._reduce_loss(loss)

    def _peer(self, pp_rank: int) -> int:
        return dist.get_global_rank(self.pp_group, pp_rank)

    @property
    def replicas(self) -> ReplicaSync | None:
        """The replica groups' layer (``engine:replica_groups``); an engine that steps itself
        after the schedule (FSDP) averages over them and commits in its own step."""
        return self._replicas

    @replicas.setter
    def replicas(self, replicas: ReplicaSync | None) -> None:
        self._replicas = replicas
        if self.inner_steps:
            self.inner.replicas = replicas

    def local_state(self) -> dict:
        return self.inner.local_state()

    def load_local_state(self, state: dict) -> None:
        self.inner.load_local_state(state)

    def save_state(self, directory: Path) -> None:
        self.inner.save_state(directory)

    def load_state(self, directory: Path) -> None:
        self.inner.load_state(directory)

    def layout_free_state(self) -> dict:
        """The strategy engine's, over this rank's stages (named as in the unsplit model)."""
        return self.inner.layout_free_state()

    def load_layout_free_state(self, state: dict) -> None:
        self.inner.load_layout_free_state(state)

    def __getattr__(self, name: str):
        """``layout_free_shards`` / ``load_layout_free_shards`` where the strategy engine has
        them (:mod:`plait.engine.layout_free` asks with ``hasattr``)."""
        if name in ("layout_free_shards", "load_layout_free_shards"):
            inner = self.__dict__.get("inner")
            if inner is not None:
                return getattr(inner, name)
        raise AttributeError(name)
