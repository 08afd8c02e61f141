"""The FSDP2 engine: plait's :class:`~plait.types.Engine` over a ``fully_shard``-ed model.

One optimizer step::

    for each micro-batch (gradient sync only on the last: set_requires_gradient_sync):
        loss = loss_fn(model(x), y) / n;  loss.backward()   # reduce-scatter on the last
    norm = ||g|| over dp shards and tensor-parallel shards;  clip;  guard;  optimizer.step()

Under pipeline stages the pipeline engine runs the forwards and backwards instead (torch's
``PipelineStage`` keeps FSDP from syncing before the last micro-batch, then reduce-scatters each
stage's gradients and divides them by the micro-batch count) and hands the rest of the step to
:meth:`FSDPEngine.step_after_backward` (``engine:pipeline_step``): the norm then also sums over
the stages. The optimizer plait's optimizer plugin built steps the sharded (DTensor) parameters;
plait's LR schedule is set on its param groups each step, as under DDP.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
import torch.distributed as dist

from plait.plugins.fsdp.materialize import experts_divided_by_engine, is_sharded, shard
from plait.plugins.optim.clip_grads import is_expert, is_tensor_parallel
from plait.plugins.optim.hyperparameters import keep_hyperparameters
from plait.plugins.optim.mixed_precision import autocast
from plait.types import Batch, StepOutput, model_inputs


def full_options(**kwargs):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kwargs)


class FSDPEngine:
    def __init__(self, cfg, model, optimizer, loss_fn, topology, hook):
        self.device = topology.device
        self.check_step = functools.partial(hook.plait_check_step, cfg=cfg, topology=topology)
        if not is_sharded(model):  # built whole, not materialized by this plugin
            model = shard(cfg, model.to(self.device), topology)
            optimizer = hook.plait_build_optimizer(cfg=cfg, model=model)
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.precision = cfg.precision
        self.grad_clip = cfg.train.grad_clip
        # the loss is averaged over the data- and context-parallel ranks
        self.dp_group = topology.get_data_parallel_group(with_context_parallel=True)
        self.dp_size = topology.dims.dp_cp
        self.tp_group = topology.get_tensor_model_parallel_group() if topology.dims.tp > 1 else None
        self.tp_rank = topology.tp_rank
        # pipeline stages hold disjoint parameters: the norm sums over them
        self.pp_group = (topology.get_pipeline_model_parallel_group() if topology.dims.pp > 1
                         else None)
        mesh = next(p for p in model.parameters()).device_mesh
        # the ranks a parameter's shards are spread over (not the HSDP replicas)
        self.shard_group = mesh.get_group(mesh.ndim - 1)
        # expert parallelism: experts are sharded over their edp group and differ across ep
        self.ep_group = topology.get_expert_parallel_group() if topology.dims.ep > 1 else None
        self.edp_group = topology.get_expert_data_parallel_group()
        self.divide_experts = experts_divided_by_engine(topology)
        self.checkpoint_name = (f"fsdp_pp{topology.pp_rank}_tp{topology.tp_rank}"
                                f"_dp{topology.dp_cp_rank}.pt")

    def _loss(self, batch: Batch) -> torch.Tensor:
        x, kwargs, y = model_inputs(batch, self.device)
        with autocast("fp32", self.device):  # FSDP's MixedPrecisionPolicy casts per module
            return self.loss_fn(self.model(x, **kwargs), y)

    def grad_norm(self) -> torch.Tensor:
        """``||g||`` over every shard: squares summed over this rank's FSDP shards, then over
        the shard group (shards are disjoint there; HSDP replicas hold the same), the
        tensor-parallel group (a replicated parameter counted on tp rank 0 only) and the
        pipeline stages (disjoint parameters); experts' over their expert-data-parallel shards,
        then the expert-parallel group::

            ||g||² = Σ_pp Σ_tp Σ_shard Σ_local g²"""
        squares = torch.zeros((), device=self.device, dtype=torch.float32)
        experts = torch.zeros((), device=self.device, dtype=torch.float32)
        for p in self.model.parameters():
            if p.grad is not None and (is_tensor_parallel(p) or self.tp_rank == 0):
                target = experts if self.ep_group is not None and is_expert(p) else squares
                target += p.grad.to_local().float().pow(2).sum()
        dist.all_reduce(squares, group=self.shard_group)
        if self.ep_group is not None:
            dist.all_reduce(experts, group=self.edp_group)
            dist.all_reduce(experts, group=self.ep_group)
            squares += experts
        if self.tp_group is not None:
            dist.all_reduce(squares, group=self.tp_group)
        if self.pp_group is not None:
            dist.all_reduce(squares, group=self.pp_group)
        return squares.sqrt()

    def clip(self, norm: torch.Tensor) -> None:
        if self.grad_clip <= 0:
            return
        coef = torch.clamp(self.grad_clip / (norm + 1e-6), max=1.0)
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.to_local().mul_(coef)

    def train_step(self, micro_batches: list[Batch], lr: float) -> StepOutput:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        n = len(micro_batches)
        total = torch.zeros((), device=self.device)
        for i, batch in enumerate(micro_batches):
            self.model.set_requires_gradient_sync(i == n - 1)
            loss = self._loss(batch)
            (loss / n).backward()
            total += loss.detach()
        mean_loss = total / n
        dist.all_reduce(mean_loss, group=self.dp_group)  # gloo has no AVG
        return self.step_after_backward(mean_loss.item() / self.dp_size, total / n)

    def step_after_backward(self, loss: float, local_loss: torch.Tensor) -> StepOutput:
        """The step after the gradients are reduce-scattered (by this engine's last
        micro-batch, or under pipeline stages by the schedule's): clip by the global norm,
        guard, step. ``loss``: the global mean; ``local_loss``: this rank's (the guard's)."""
        if self.divide_experts:
            for p in self.model.parameters():
                if p.grad is not None and is_expert(p):
                    p.grad.to_local().div_(self.dp_size)
        norm = self.grad_norm()
        self.clip(norm)
        skipped = any(self.check_step(loss=local_loss, grad_norm=norm))
        if not skipped:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepOutput(loss=loss, grad_norm=float(norm), skipped=skipped)

    @torch.no_grad()
    def eval_loss(self, batch: Batch) -> float:
        self.model.eval()
        loss = self._loss(batch).detach().float()
        self.model.train()
        dist.all_reduce(loss, group=self.dp_group)
        return loss.item() / self.dp_size

    def save_state(self, directory: Path) -> None:
        """Each rank's own shards (DTensors' local parts) with the optimizer's."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        torch.save({"model": {k: v.to_local() for k, v in model_state.items()},
                    "optimizer": _local(optim_state)}, directory / self.checkpoint_name)

    def load_state(self, directory: Path) -> None:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        saved = torch.load(directory / self.checkpoint_name, map_location=self.device,
                           weights_only=True)
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        with torch.no_grad():
            for name, value in model_state.items():
                value.to_local().copy_(saved["model"][name])
            _copy_local(optim_state["state"], saved["optimizer"]["state"])
        with keep_hyperparameters(self.optimizer):
            from torch.distributed.checkpoint.state_dict import set_state_dict

            set_state_dict(self.model, self.optimizer, model_state_dict=model_state,
                           optim_state_dict=optim_state)

    def layout_free_state(self) -> dict:
        """Full tensors by the unsplit names (the dp shards gathered; tensor-parallel shards stay
        this rank's): the form :mod:`plait.plugins.checkpoint.layout_free` writes."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(self.model, self.optimizer,
                                                  options=full_options())
        return {"model": model_state, "optim": optim_state["state"]}

    def load_layout_free_state(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        _, current = get_state_dict(self.model, self.optimizer, options=full_options())
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict={"state": state["optim"],
                                         "param_groups": current["param_groups"]},
                       options=full_options())


def _local(optim_state: dict) -> dict:
    return {"state": {name: {k: v.to_local() if hasattr(v, "to_local") else v
                             for k, v in entries.items()}
                      for name, entries in optim_state["state"].items()},
            "param_groups": optim_state["param_groups"]}


def _copy_local(current: dict, saved: dict) -> None:
    for name, entries in current.items():
        for key, value in entries.items():
            if hasattr(value, "to_local"):
                value.to_local().copy_(saved[name][key])
            else:
                entries[key] = saved[name][key]
