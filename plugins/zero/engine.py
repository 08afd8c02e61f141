"""The ZeRO engine: plait's :class:`~plait.types.Engine` over ``deepspeed.initialize``.

One optimizer step is what DeepSpeed's own loop does, micro-batch by micro-batch::

    for x, y in micro_batches:
        loss = loss_fn(engine(x), y)
        engine.backward(loss)   # scales by 1/gradient_accumulation_steps
        engine.step()           # reduces / partitions grads; clips and steps at the boundary

plait's LR schedule is applied by setting ``lr`` on DeepSpeed's optimizer param groups before each
step, exactly as DDP does, so a run's per-step LR does not depend on the strategy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from plait.types import Batch, StepOutput

TAG = "deepspeed"  # DeepSpeed's checkpoint tag: files go to <checkpoint dir>/deepspeed/


class TopologyMPU:
    """DeepSpeed's ``mpu`` interface (Megatron's names) over plait's Topology.

    DeepSpeed shards ZeRO states over ``get_data_parallel_group()`` and reduces the gradient norm
    over ``get_model_parallel_group()``, so ZeRO-1/2 compose with plait's tensor parallelism:
    "model parallel" is Megatron's tensor-parallel group.
    """

    def __init__(self, topology):
        self.topology = topology

    def get_data_parallel_group(self):
        return self.topology.get_data_parallel_group()

    def get_data_parallel_rank(self) -> int:
        return self.topology.dp_rank

    def get_data_parallel_world_size(self) -> int:
        return self.topology.dims.dp

    def get_data_parallel_group_ranks(self) -> list[int]:
        return dist.get_process_group_ranks(self.get_data_parallel_group())

    def get_tensor_model_parallel_group(self):
        return self.topology.get_tensor_model_parallel_group()

    def get_tensor_model_parallel_rank(self) -> int:
        return self.topology.tp_rank

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.topology.dims.tp

    def get_tensor_model_parallel_src_rank(self) -> int:
        return dist.get_process_group_ranks(self.get_tensor_model_parallel_group())[0]

    get_model_parallel_group = get_tensor_model_parallel_group
    get_model_parallel_rank = get_tensor_model_parallel_rank
    get_model_parallel_world_size = get_tensor_model_parallel_world_size

    def get_pipeline_model_parallel_group(self):
        return self.topology.get_pipeline_model_parallel_group()

    def get_pipeline_model_parallel_rank(self) -> int:
        return self.topology.pp_rank

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self.topology.dims.pp


def optimizer_param_groups(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The parameter grouping of plait's optimizer plugin (e.g. which tensors get weight decay),
    without its tensors' optimizer state, for DeepSpeed to build its optimizer over."""
    return [{k: v for k, v in g.items() if k not in ("lr", "initial_lr")}
            for g in optimizer.param_groups]


class ZeroEngine:
    def __init__(self, cfg, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 loss_fn: Callable, topology, ds_config: dict[str, Any]):
        import deepspeed

        self.loss_fn = loss_fn
        self.topology = topology
        self.dp_group = topology.get_data_parallel_group()
        self.dp_size = topology.dims.dp
        client = "optimizer" not in ds_config  # an in-house optimizer plugin's torch optimizer
        self.ds, *_ = deepspeed.initialize(
            model=model,
            model_parameters=optimizer_param_groups(optimizer),
            optimizer=optimizer if client else None,
            config=ds_config,
            mpu=TopologyMPU(topology),
            dist_init_required=False,
        )
        self.model = self.ds.module
        self.device = self.ds.device
        self.model_state_bytes: dict[str, int] | None = None

    def _loss(self, batch: Batch) -> torch.Tensor:
        x, y = (t.to(self.device, non_blocking=True) for t in batch)
        return self.loss_fn(self.ds(x), y)

    def _mean_over_dp(self, value: torch.Tensor) -> float:
        if self.dp_size > 1:
            dist.all_reduce(value, group=self.dp_group)  # gloo has no AVG
            value = value / self.dp_size
        return value.item()

    def train_step(self, micro_batches: list[Batch], lr: float) -> StepOutput:
        for group in self.ds.optimizer.param_groups:
            group["lr"] = lr
        total = torch.zeros((), device=self.device)
        for i, batch in enumerate(micro_batches):
            loss = self._loss(batch)
            self.ds.backward(loss)
            if i == 0 and self.model_state_bytes is None and self.ds.global_steps >= 1:
                # Parameters, (accumulating) gradients and optimizer states all live here, once
                # the optimizer has stepped; the last backward of a step frees what ZeRO-1
                # would otherwise show as full gradients.
                from plait.plugins.zero.estimate import measure_deepspeed_engine

                self.model_state_bytes = self._max_over_ranks(measure_deepspeed_engine(self.ds))
            self.ds.step()
            total += loss.detach().float()
        grad_norm = self.ds.get_global_grad_norm()
        grad_norm = float(grad_norm) if grad_norm is not None else float("nan")
        metrics = {f"model_state_bytes/{k}": float(v)
                   for k, v in (self.model_state_bytes or {}).items()}
        return StepOutput(loss=self._mean_over_dp(total / len(micro_batches)),
                          grad_norm=grad_norm, metrics=metrics)

    def _max_over_ranks(self, figures: dict[str, int]) -> dict[str, int]:
        """The largest rank's bytes (ZeRO's partitions differ by padding at most)."""
        values = torch.tensor(list(figures.values()), dtype=torch.float64, device=self.device)
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
        return dict(zip(figures, (int(v) for v in values.tolist())))

    @torch.no_grad()
    def eval_loss(self, batch: Batch) -> float:
        self.ds.eval()
        loss = self._loss(batch).detach().float()
        self.ds.train()
        return self._mean_over_dp(loss)

    def save_state(self, directory: Path) -> None:
        self.ds.save_checkpoint(str(directory), tag=TAG, save_latest=False)

    def load_state(self, directory: Path) -> None:
        path, _ = self.ds.load_checkpoint(str(directory), tag=TAG, load_optimizer_states=True,
                                          load_lr_scheduler_states=False)
        if path is None:
            raise ValueError(f"{directory}: no DeepSpeed checkpoint (tag {TAG!r}) in it; it was "
                             "not written by strategy=zero*")
