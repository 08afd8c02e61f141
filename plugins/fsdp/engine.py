"""The FSDP2 engine: plait's :class:`~plait.types.Engine` over a ``fully_shard``-ed model.

One optimizer step is the base step (:mod:`plait.engine.step`)::

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

import contextlib
from pathlib import Path

import torch

from plait.engine.experts import divide_expert_gradients
from plait.engine.hyperparameters import keep_hyperparameters
from plait.engine.norm import ShardGroups
from plait.engine.step import TorchEngine
from plait.plugins.fsdp.materialize import experts_divided_by_engine, is_sharded, shard
from plait.types import StepOutput


def full_options(**kwargs):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kwargs)


class FSDPEngine(TorchEngine):
    """The base step (:class:`plait.engine.step.TorchEngine`) with FSDP's own parts: the model
    sharded by ``fully_shard``, gradient sync on the last micro-batch only, the norm summed over
    the shard group (and the experts' shard group), expert gradients divided by ``dp`` where
    FSDP summed them. No loss scaler and no autocast: FSDP's ``MixedPrecisionPolicy`` casts per
    module."""

    def __init__(self, cfg, model, optimizer, loss_fn, topology, hook):
        if not is_sharded(model):  # built whole, not materialized by this plugin
            model = shard(cfg, model.to(topology.device), topology)
            optimizer = hook.plait_build_optimizer(cfg=cfg, model=model)
        mesh = next(p for p in model.parameters()).device_mesh
        # the ranks a parameter's shards are spread over (not the HSDP replicas); experts are
        # sharded over their expert-data-parallel group
        groups = ShardGroups.of(
            topology, shard=mesh.get_group(mesh.ndim - 1), expert_shard=topology.group("edp")
        )
        super().__init__(
            cfg,
            topology,
            hook,
            model,
            optimizer,
            loss_fn,
            shard_groups=groups,
            loss_scaling=False,
            autocast_forward=False,
        )
        self.divide_experts = experts_divided_by_engine(topology)
        self.checkpoint_name = (
            f"fsdp_pp{topology.pp_rank}_tp{topology.tp_rank}_dp{topology.dp_cp_rank}.pt"
        )

    def sync(self, last: bool):
        self.model.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    def reduce_gradients(self) -> None:
        if self.divide_experts:
            divide_expert_gradients(self.model.parameters(), self.loss_size)

    def step_after_backward(self, loss: float, local_loss: torch.Tensor) -> StepOutput:
        """The step after the gradients are reduce-scattered by a pipeline schedule
        (``engine:pipeline_step``): the base step's second half. ``loss``: the global mean;
        ``local_loss``: this rank's (the guard's)."""
        grad_norm, skipped, _ = self.finish_step(local_loss)
        return StepOutput(loss=loss, grad_norm=float(grad_norm), skipped=skipped)

    def save_state(self, directory: Path) -> None:
        torch.save(self.local_state(), directory / self.checkpoint_name)

    def load_state(self, directory: Path) -> None:
        self.load_local_state(
            torch.load(
                directory / self.checkpoint_name, map_location=self.device, weights_only=True
            )
        )

    def local_state(self) -> dict:
        """Each rank's own shards (DTensors' local parts) with the optimizer's: what its file
        holds, and what a recovering replica group takes from this rank."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        return {
            "model": {k: v.to_local() for k, v in model_state.items()},
            "optimizer": _local(optim_state),
        }

    def load_local_state(self, saved: dict) -> None:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        with torch.no_grad():
            for name, value in model_state.items():
                value.to_local().copy_(saved["model"][name])
            _copy_local(optim_state["state"], saved["optimizer"]["state"])
        with keep_hyperparameters(self.optimizer):
            from torch.distributed.checkpoint.state_dict import set_state_dict

            set_state_dict(
                self.model,
                self.optimizer,
                model_state_dict=model_state,
                optim_state_dict=optim_state,
            )

    def layout_free_state(self) -> dict:
        """Full tensors by the unsplit names (the dp shards gathered; tensor-parallel shards stay
        this rank's): the form :mod:`plait.engine.layout_free` writes."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(
            self.model, self.optimizer, options=full_options()
        )
        return {"model": model_state, "optim": optim_state["state"]}

    def layout_free_shards(self) -> dict:
        """This rank's shards by the unsplit names, DTensors over the dp mesh, nothing gathered
        (:mod:`plait.engine.layout_free` writes each where it sits in the whole tensor)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optim": optim_state["state"]}

    def load_layout_free_shards(self, state: dict) -> None:
        """The shards were read into this engine's own parameters and optimizer states in
        place; the optimizer takes its state back as it is (no copy)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        _, current = get_state_dict(self.model, self.optimizer)
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict={"state": state["optim"], "param_groups": current["param_groups"]},
        )

    def load_layout_free_state(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        _, current = get_state_dict(self.model, self.optimizer, options=full_options())
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict={"state": state["optim"], "param_groups": current["param_groups"]},
            options=full_options(),
        )


def _local(optim_state: dict) -> dict:
    return {
        "state": {
            name: {k: v.to_local() if hasattr(v, "to_local") else v for k, v in entries.items()}
            for name, entries in optim_state["state"].items()
        },
        "param_groups": optim_state["param_groups"],
    }


def _copy_local(current: dict, saved: dict) -> None:
    for name, entries in current.items():
        for key, value in entries.items():
            if hasattr(value, "to_local"):
                value.to_local().copy_(saved[name][key])
            else:
                entries[key] = saved[name][key]
