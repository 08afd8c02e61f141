"""The ZeRO engine: plait's :class:`~plait.types.Engine` over ``deepspeed.initialize``.

One optimizer step is what DeepSpeed's own loop does, micro-batch by micro-batch::

    for x, y in micro_batches:
        loss = loss_fn(engine(x), y)
        engine.backward(loss)   # scales by 1/gradient_accumulation_steps
        engine.step()           # reduces / partitions grads; clips and steps at the boundary

plait's LR schedule is applied by setting ``lr`` on DeepSpeed's optimizer param groups before each
step (:func:`plait.engine.hyperparameters.set_lr`), exactly as every engine does, so a run's
per-step LR does not depend on the strategy; the loss is averaged over dp by the engine
library's :func:`~plait.engine.step.mean_over`, and DeepSpeed computes the norm, clips and asks
the step guard (``guard.py``) inside its own step.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from plait.engine.hyperparameters import keep_hyperparameters, set_lr
from plait.engine.state_by_name import load_state_by_name, state_by_name
from plait.engine.step import mean_over
from plait.plugins.zero.fp32_master import share_fp32_partitions
from plait.plugins.zero.sizing import param_groups_within, split_to_count
from plait.types import Batch, StepOutput, model_inputs

TAG = "deepspeed"  # DeepSpeed's checkpoint tag: files go to <checkpoint dir>/deepspeed/


class TopologyMPU:
    """DeepSpeed's ``mpu`` interface (Megatron's names) over plait's Topology.

    DeepSpeed shards ZeRO states over ``get_data_parallel_group()`` and reduces the gradient norm
    over ``get_model_parallel_group()``, counting a parameter that is not split by tensor
    parallelism only on tensor-parallel rank 0. As in DeepSpeed's own ``PipelineParallelGrid``,
    "model parallel" is every model-parallel axis: the ranks of all pipeline stages and tensor
    shards that hold one replica (same dp rank), so the norm is the whole model's; its rank names
    the checkpoint files (``mp_rank_XX``), one per stage and shard. DeepSpeed asks for these per
    parameter on hot paths, so groups and ranks are looked up once (a mesh slice per call costs
    time). These Megatron names live here only because DeepSpeed's ``mpu`` calls them; plait
    itself names every group ``topology.group(name)``.
    """

    def __init__(self, topology):
        dims = topology.dims
        self.dp_group = topology.group("dp")
        self.tp_group = topology.group("tp")
        self.mp_group, self.mp_rank, self.mp_size = self.tp_group, topology.tp_rank, dims.tp
        if dims.pp > 1:
            self.mp_group = topology.group("replica")
            self.mp_rank = topology.pp_rank * dims.tp + topology.tp_rank
            self.mp_size = dims.pp * dims.tp
        self.pp_group = topology.group("pp")
        self.dp_rank, self.tp_rank, self.pp_rank = (
            topology.dp_rank,
            topology.tp_rank,
            topology.pp_rank,
        )
        self.dp_size, self.tp_size, self.pp_size = dims.dp, dims.tp, dims.pp
        self.dp_ranks = dist.get_process_group_ranks(self.dp_group)
        self.tp_src_rank = dist.get_process_group_ranks(self.tp_group)[0]
        self.cp_group, self.cp_rank, self.cp_size = topology.group("cp"), topology.cp_rank, dims.cp
        self.dp_cp_group = topology.group("dp_cp")
        self.dp_cp_rank, self.dp_cp_size = topology.dp_cp_rank, dims.dp_cp

    def get_data_parallel_group(self):
        return self.dp_group

    def get_data_parallel_rank(self) -> int:
        return self.dp_rank

    def get_data_parallel_world_size(self) -> int:
        return self.dp_size

    def get_data_parallel_group_ranks(self) -> list[int]:
        return self.dp_ranks

    def get_tensor_model_parallel_group(self):
        return self.tp_group

    def get_tensor_model_parallel_rank(self) -> int:
        return self.tp_rank

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.tp_size

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self.tp_src_rank

    def get_model_parallel_group(self):
        return self.mp_group

    def get_model_parallel_rank(self) -> int:
        return self.mp_rank

    def get_model_parallel_world_size(self) -> int:
        return self.mp_size

    def get_pipeline_model_parallel_group(self):
        return self.pp_group

    def get_pipeline_model_parallel_rank(self) -> int:
        return self.pp_rank

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self.pp_size

    def get_sequence_parallel_group(self):
        return self.cp_group

    def get_sequence_parallel_rank(self) -> int:
        return self.cp_rank

    def get_sequence_parallel_world_size(self) -> int:
        return self.cp_size

    def get_sequence_data_parallel_group(self):
        return self.dp_cp_group

    def get_sequence_data_parallel_rank(self) -> int:
        return self.dp_cp_rank

    def get_sequence_data_parallel_world_size(self) -> int:
        return self.dp_cp_size


def optimizer_param_groups(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The parameter grouping of plait's optimizer plugin (which tensors get weight decay), for
    DeepSpeed to build its AdamW over; every other hyperparameter comes from the DeepSpeed
    config, so it is written in one place."""
    return [
        {"params": g["params"], "weight_decay": g["weight_decay"]} for g in optimizer.param_groups
    ]


class ZeroEngine:
    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable,
        topology,
        ds_config: dict[str, Any],
        check_step: Callable[..., list],
    ):
        import deepspeed

        from plait.plugins.zero.guard import DeepSpeedStepGuard

        self.loss_fn = loss_fn
        self.topology = topology
        # the loss is averaged over the data- and context-parallel ranks
        self.dp_group = topology.group("dp_cp")
        self.dp_size = topology.dims.dp_cp
        self.backward_scale = 1 / topology.dims.cp  # DeepSpeed sums over sequence parallelism
        client = "optimizer" not in ds_config  # an in-house optimizer plugin's torch optimizer
        zero = ds_config.get("zero_optimization", {})
        self.stage = zero.get("stage", 0)
        param_groups = None if client else optimizer_param_groups(optimizer)
        if param_groups and self.stage in (1, 2) and "sub_group_size" in zero:
            # sizing.py: ZeRO-1/2 step their partition in sub-groups
            param_groups = param_groups_within(
                param_groups, self.dp_size * int(zero["sub_group_size"])
            )
            if topology.dims.pp > 1:  # as many sub-groups on every stage (sizing.py)
                count = torch.tensor(len(param_groups))
                dist.all_reduce(count, op=dist.ReduceOp.MAX, group=topology.group("replica"))
                param_groups = split_to_count(param_groups, int(count))
        # Expert parallelism: DeepSpeed-MoE's expert param groups (experts.py)
        self.saves_engine_files = topology.dims.ep == 1
        if topology.dims.ep > 1:
            from plait.plugins.zero.experts import moe_marker, named_param_groups

            n_experts = max(
                m.n_experts for m in model.modules() if getattr(m, "is_moe_layer", False)
            )
            model.add_module("deepspeed_moe_marker", moe_marker(topology, n_experts))
            param_groups = param_groups and named_param_groups(param_groups)
        self.ds, *_ = deepspeed.initialize(
            model=model,
            model_parameters=param_groups,
            optimizer=optimizer if client else None,
            config=ds_config,
            mpu=TopologyMPU(topology),
            dist_init_required=False,
        )
        if topology.dims.ep > 1:  # DeepSpeed has read it; the model is plait's again
            del model._modules["deepspeed_moe_marker"]
        self.model = self.ds.module
        share_fp32_partitions(self.ds.optimizer)  # ZeRO-3 in fp32: no second copy (fp32_master.py)
        self.optimizer = self.ds.optimizer  # its param_groups are the stepping optimizer's
        # ZeRO's optimizers (and DeepSpeed's bf16/fp16 ones) keep the global norm they clipped
        # with; stage 0 in fp32 clips in ``engine.clip_fp32_gradients`` and drops the norm, so
        # that method is replaced by the same call keeping its result (no second pass).
        self.reports_grad_norm = hasattr(self.ds.optimizer, "_global_grad_norm")
        self.stage0_norm: float | None = None
        if not self.reports_grad_norm:
            self.ds.clip_fp32_gradients = self._clip_fp32_gradients
        # plait_check_step is asked inside DeepSpeed's step, where DeepSpeed checks for overflow
        self.guard = DeepSpeedStepGuard(
            self.ds.optimizer,
            check_step,
            lambda: self.stage0_norm,
            loss_scaled=self.ds.fp16_enabled(),
        )
        self.device = self.ds.device
        self.model_state_bytes: dict[str, int] | None = None

    def _loss(self, batch: Batch) -> torch.Tensor:
        x, kwargs, y = model_inputs(batch, self.device)
        return self.loss_fn(self.ds(x, **kwargs), y)

    def train_step(self, micro_batches: list[Batch], lr: float) -> StepOutput:
        set_lr(self.ds.optimizer, lr)
        total = torch.zeros((), device=self.device)
        for i, batch in enumerate(micro_batches):
            loss = self._loss(batch)
            self.ds.backward(loss * self.backward_scale if self.backward_scale != 1 else loss)
            if i == 0:
                # Parameters, (accumulating) gradients and optimizer states all live here, once
                # the optimizer has stepped; the last backward of a step frees what ZeRO-1
                # would otherwise show as full gradients.
                self._measure_model_states()
            total += loss.detach().float()
            last = i == len(micro_batches) - 1
            if last:
                if not self.reports_grad_norm and self.ds.gradient_clipping() == 0:
                    self._clip_fp32_gradients(max_norm=math.inf)  # only measures: DeepSpeed won't
                local_loss = total / len(micro_batches)
                self.guard.arm(local_loss)
                loss = mean_over(local_loss.clone(), self.dp_group, self.dp_size)  # overlaps
            self.ds.step()
        grad_norm = self.ds.get_global_grad_norm() if self.reports_grad_norm else self.stage0_norm
        grad_norm = float(grad_norm) if grad_norm is not None else float("nan")
        metrics = self._model_state_metrics()
        if self.ds.fp16_enabled():  # dynamic loss scaling: show the scale and skipped steps
            metrics["loss_scale"] = float(getattr(self.ds.optimizer, "loss_scale", float("nan")))
            metrics["skipped_steps"] = float(self.ds.skipped_steps)
        return StepOutput(
            loss=loss(), grad_norm=grad_norm, metrics=metrics, skipped=self.guard.settle()
        )

    def step_after_backward(self, loss: float, local_loss: torch.Tensor) -> StepOutput:
        """The optimizer step after a backward that ran outside DeepSpeed (the pipeline
        schedule's), as DeepSpeed's own pipeline engine does it: ZeRO-1 averages the gradients
        over dp into each rank's partition, clips by the global norm, steps its partition of the
        optimizer states and all-gathers the parameters. Reports the pre-clipping norm.
        ``loss`` is the global mean, ``local_loss`` this rank's (what the step guard sees)."""
        self._measure_model_states()
        self.ds.set_gradient_accumulation_boundary(True)
        self.ds.optimizer.reduce_gradients(pipeline_parallel=True)
        self.guard.arm(local_loss)
        self.ds.step()
        return StepOutput(
            loss=loss,
            grad_norm=float(self.ds.get_global_grad_norm()),
            metrics=self._model_state_metrics(),
            skipped=self.guard.settle(),
        )

    def _measure_model_states(self) -> None:
        """Once, after a backward of the second step (every rank calls it at the same point)."""
        if self.model_state_bytes is None and self.ds.global_steps >= 1:
            from plait.plugins.zero.estimate import measure_deepspeed_engine

            self.model_state_bytes = self._max_over_ranks(measure_deepspeed_engine(self.ds))

    def _model_state_metrics(self) -> dict[str, float]:
        return {
            f"model_state_bytes/{k}": float(v) for k, v in (self.model_state_bytes or {}).items()
        }

    def _clip_fp32_gradients(self, max_norm: float | None = None) -> None:
        """DeepSpeed's stage-0 clipping (``DeepSpeedEngine.clip_fp32_gradients``), keeping the
        pre-clipping global norm it computes; ``max_norm=inf`` measures without clipping."""
        from deepspeed.runtime.utils import clip_grad_norm_

        limit = self.ds.gradient_clipping() if max_norm is None else max_norm
        self.stage0_norm = float(
            clip_grad_norm_(self.model.parameters(), max_norm=limit, mpu=self.ds.mpu)
        )

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
        return mean_over(loss, self.dp_group, self.dp_size)()

    def save_state(self, directory: Path) -> None:
        self.ds.save_checkpoint(str(directory), tag=TAG, save_latest=False)

    def load_state(self, directory: Path) -> None:
        with keep_hyperparameters(self.ds.optimizer):
            path, _ = self.ds.load_checkpoint(
                str(directory), tag=TAG, load_optimizer_states=True, load_lr_scheduler_states=False
            )
        if path is None:
            raise ValueError(
                f"{directory}: no DeepSpeed checkpoint (tag {TAG!r}) in it; it was "
                "not written by strategy=zero*"
            )

    def own_files_mismatch(self, directory: Path) -> str | None:
        """The setting, as ``key=value``, with which DeepSpeed's files in ``directory`` were
        written at this same layout but cannot be loaded here (None: they can). DeepSpeed keeps
        ZeRO's optimizer state per sub-group, which ``sub_group_size`` makes (``sizing.py``),
        and its ``load_checkpoint`` fails on other groups (ZeRO-1/2: ``The ZeRO checkpoint
        parameter-alignment layout does not match``; ZeRO-3: torch's ``loaded state dict
        contains a parameter group that doesn't match``). Read from the ``ds_config`` DeepSpeed
        saves in this rank's optimizer file (memory-mapped: the states are not read), the same
        on every rank."""
        if self.stage == 0:
            return None
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

        file = Path(self.ds._get_zero_ckpt_name(str(directory), TAG))
        if not file.exists():
            return None  # load_state says what is missing
        saved = torch.load(file, map_location="cpu", mmap=True, weights_only=False)
        default = DeepSpeedZeroConfig.model_fields["sub_group_size"].default
        written = int(saved["ds_config"]["zero_optimization"].get("sub_group_size", default))
        current = int(self.ds.zero_sub_group_size())
        if written == current:
            return None
        return f"strategy.deepspeed.zero_optimization.sub_group_size={written}"

    def layout_free_state(self) -> dict:
        """The fp32 master parameters and Adam states, full over the dp group, by parameter
        name, and under fp16 the dynamic loss scaler's state (``loss_scale.py``). See
        :mod:`plait.engine.layout_free`."""
        from plait.plugins.zero.loss_scale import dynamic_loss_scaler, loss_scaler_state

        state = self._parameter_state()
        scaler = dynamic_loss_scaler(self.ds.optimizer)
        if scaler is not None:
            state["loss_scale"] = {
                **loss_scaler_state(scaler),
                "skipped_steps": torch.tensor(self.ds.skipped_steps),
            }
        return state

    def _parameter_state(self) -> dict:
        """DeepSpeed's ``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state``
        (collectives on every rank); stage 0 in fp32 keeps a plain torch optimizer, read with
        DCP's ``get_state_dict`` as DDP's is, and in 16 bits the masters of DeepSpeed's
        wrapper (:meth:`_stage_0_masters`)."""
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        if self.stage == 0 and isinstance(self.ds.optimizer, torch.optim.Optimizer):
            return state_by_name(self.model, self.ds.optimizer)
        self._link_optimizer_states()
        model, optim = {}, {}
        if self.stage == 0:
            states = self.ds.optimizer.optimizer.state
            for name, master in self._stage_0_masters().items():
                model[name], optim[name] = master.detach(), dict(states[master])
        else:
            step = self._optimizer_step()
            keys = self._optimizer_state_keys()
            for name, param in self.model.named_parameters():
                model[name] = safe_get_full_fp32_param(param)
                optim[name] = {key: safe_get_full_optimizer_state(param, key) for key in keys} | {
                    "step": step
                }
        for name, param in self.model.named_parameters(remove_duplicate=False):
            if name not in model:  # a tied parameter's other names, as in DDP's state dict
                model[name] = model[self._first_name(param)]
        return {"model": model, "optim": optim}

    def layout_free_shards(self) -> dict:
        """The same state as :meth:`layout_free_state`, nothing gathered: each rank's fp32
        partitions and Adam states as :class:`~plait.engine.pieces.Pieces` (flat ranges of each
        parameter, views of DeepSpeed's own flat buffers): ZeRO-1/2's fragments
        (``_hp_mapping``), ZeRO-3's partitions (``get_local_fp32_param``). Stage 0 holds whole
        tensors already."""
        if self.stage == 0:
            return self.layout_free_state()
        self._link_optimizer_states()
        step = self._optimizer_step()
        keys = self._optimizer_state_keys()
        model, optim = {}, {}
        for name, param in self.model.named_parameters():
            model[name] = self._pieces(param)
            optim[name] = {key: self._pieces(param, key) for key in keys} | {"step": step}
        for name, param in self.model.named_parameters(remove_duplicate=False):
            if name not in model:  # a tied parameter's other names
                model[name] = model[self._first_name(param)]
        state = {"model": model, "optim": optim}
        from plait.plugins.zero.loss_scale import dynamic_loss_scaler, loss_scaler_state

        loss_scaler = dynamic_loss_scaler(self.ds.optimizer)
        if loss_scaler is not None:
            state["loss_scale"] = {
                **loss_scaler_state(loss_scaler),
                "skipped_steps": torch.tensor(self.ds.skipped_steps),
            }
        return state

    def _pieces(self, param: torch.nn.Parameter, key: str | None = None):
        """This rank's part of ``param``'s fp32 master (or its optimizer state ``key``)."""
        from plait.engine.pieces import Pieces, flat_pieces

        shape = tuple(getattr(param, "ds_shape", param.shape))
        if self.stage == 3:
            zero = param._z3_optimizer
            local = zero.get_local_fp32_param(param, key)
            start = zero._get_param_partition_rank(param) * local.numel()
            held = max(0, min(local.numel(), param.ds_numel - start))
            return Pieces(shape, flat_pieces(shape, start, local.flatten()[:held]))
        mapping = getattr(param, "_hp_mapping", None)
        if mapping is None:  # every element of it is in other ranks' partitions
            return Pieces(shape, [])
        address = mapping.lp_fragment_address
        fragment = mapping.get_hp_fragment(key).flatten()
        return Pieces(shape, flat_pieces(shape, address.start, fragment[: address.numel]))

    def load_layout_free_shards(self, state: dict) -> None:
        """The partitions were read into DeepSpeed's buffers in place; the working copies the
        forward uses are refreshed from them (ZeRO-1/2: each rank's partition all-gathered into
        the whole parameters, as after a step; ZeRO-3: this rank's partition), and the step
        count and loss scale set."""
        from plait.plugins.zero.loss_scale import dynamic_loss_scaler, load_loss_scaler_state

        if self.stage == 0:
            self.load_layout_free_state(state)
            return
        zero = self.ds.optimizer
        with torch.no_grad():
            if self.stage == 3:
                for param in self.model.parameters():
                    master = param._z3_optimizer.get_local_fp32_param(param)
                    if master.data_ptr() != param.ds_tensor.data_ptr():
                        param.ds_tensor.data.copy_(master.view_as(param.ds_tensor))
            else:
                zero.update_lp_params()
        self._set_optimizer_step(next(iter(state["optim"].values()))["step"])
        scaler = dynamic_loss_scaler(zero)
        if scaler is not None and "loss_scale" in state:
            load_loss_scaler_state(scaler, state["loss_scale"])
            self.ds.skipped_steps = int(state["loss_scale"]["skipped_steps"])

    def _stage_0_masters(self) -> dict[str, torch.Tensor]:
        """Stage 0 in bf16/fp16: DeepSpeed's ``FP16_UnfusedOptimizer`` keeps an fp32 master
        copy of every 16-bit parameter (``fp32_groups``, in the order of ``fp16_groups``); its
        torch optimizer steps those. By the 16-bit parameter's name."""
        wrapper = self.ds.optimizer
        if not hasattr(wrapper, "fp32_groups"):
            raise NotImplementedError(
                f"strategy=zero0 with DeepSpeed's {type(wrapper).__name__}"
                ": plait reads the fp32 masters of FP16_UnfusedOptimizer "
                "only (AdamW through torch, or a client optimizer)"
            )
        name_of = {id(p): n for n, p in self.model.named_parameters()}
        return {
            name_of[id(low)]: master
            for lows, masters in zip(wrapper.fp16_groups, wrapper.fp32_groups)
            for low, master in zip(lows, masters)
        }

    def _optimizer_state_keys(self) -> list[str]:
        """The per-element states of the torch optimizer DeepSpeed steps (Adam's two moments;
        an in-house client optimizer's own, or none): tensors of the flat partitions' state."""
        inner = getattr(self.ds.optimizer, "optimizer", self.ds.optimizer)
        return sorted(
            {
                key
                for state in inner.state.values()
                for key, value in state.items()
                if torch.is_tensor(value) and value.dim() > 0
            }
        )

    def _first_name(self, param: torch.nn.Parameter) -> str:
        return next(n for n, p in self.model.named_parameters() if p is param)

    def load_layout_free_state(self, state: dict) -> None:
        from plait.plugins.zero.loss_scale import dynamic_loss_scaler, load_loss_scaler_state

        self._load_parameter_state(state)
        scaler = dynamic_loss_scaler(self.ds.optimizer)
        if scaler is not None and "loss_scale" in state:
            load_loss_scaler_state(scaler, state["loss_scale"])
            self.ds.skipped_steps = int(state["loss_scale"]["skipped_steps"])

    def _load_parameter_state(self, state: dict) -> None:
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        if self.stage == 0 and isinstance(self.ds.optimizer, torch.optim.Optimizer):
            load_state_by_name(self.model, self.ds.optimizer, state)
            return
        if self.stage == 0:
            params, states = dict(self.model.named_parameters()), self.ds.optimizer.optimizer.state
            with torch.no_grad():
                for name, master in self._stage_0_masters().items():
                    master.copy_(state["model"][name])
                    states[master].update(state["optim"][name])
                    params[name].copy_(master)
            return
        for name, param in self.model.named_parameters():
            safe_set_full_fp32_param(param, state["model"][name])
            for key, value in state["optim"][name].items():
                if key != "step":
                    safe_set_full_optimizer_state(param, value, key)
            self._set_working_copy(param, state["model"][name])
        self._set_optimizer_step(next(iter(state["optim"].values()))["step"])

    def _set_working_copy(self, param: torch.nn.Parameter, value: torch.Tensor) -> None:
        """The (16-bit) parameter the forward uses, beside the fp32 master. ZeRO-1/2 keep it
        whole on every rank. ZeRO-3 keeps only this rank's partition: it is written as
        DeepSpeed's docs have users modify a partitioned parameter, inside
        ``GatheredParameters(modifier_rank=0)``, which partitions dp rank 0's edit again."""
        from deepspeed.runtime.zero.partition_parameters import GatheredParameters

        with GatheredParameters([param], modifier_rank=0, enabled=self.stage == 3), torch.no_grad():
            param.copy_(value)

    def _link_optimizer_states(self) -> None:
        """Give every parameter's fragment its optimizer states (what ``safe_get_full_
        optimizer_state`` reads). A fresh engine has none yet: they are created as torch's
        ``_init_optim_state`` does (one step with zero gradients at lr 0, which changes no
        parameter), to be overwritten by a load. ZeRO-1/2 link them after the first param
        group's first step, while the others have no states yet (DeepSpeed 0.19), so every
        group is linked again here. ZeRO-3's flat fp32 partitions sit in the torch optimizer's
        param groups only while it steps (``_optimizer_step``), so they are put there for this
        step too: without them it steps nothing, and a fresh ZeRO-3 engine offered no Adam
        moments to load into (a resume into ZeRO-3 then started from zero moments)."""
        from deepspeed.utils import lazy_init_hp_params_optimizer_state

        zero = self.ds.optimizer
        inner = zero.optimizer
        if not inner.state:
            stage_3 = hasattr(zero, "fp32_partitioned_groups_flat")
            if stage_3:
                zero._set_fp32_optimizer_param_groups()
            lrs = [group["lr"] for group in inner.param_groups]
            for group in inner.param_groups:
                group["lr"] = 0.0
                for p in group["params"]:
                    p.grad = torch.zeros_like(p)
            inner.step()
            for group, lr in zip(inner.param_groups, lrs):
                group["lr"] = lr
                for p in group["params"]:
                    p.grad = None
            if stage_3:
                zero._clear_fp32_optimizer_param_groups()
        if hasattr(zero, "single_partition_of_fp32_groups"):  # ZeRO-1/2
            for lp, hp in zip(zero.bit16_groups, zero.single_partition_of_fp32_groups):
                lazy_init_hp_params_optimizer_state(lp, hp, inner.state)

    def _inner_optimizer_states(self) -> list[dict]:
        """The torch optimizer states behind ZeRO's flat partitions."""
        inner = getattr(self.ds.optimizer, "optimizer", self.ds.optimizer)
        return list(inner.state.values())

    def _optimizer_step(self) -> torch.Tensor:
        steps = [s["step"] for s in self._inner_optimizer_states() if "step" in s]
        value = steps[0] if steps else 0
        return torch.as_tensor(value, dtype=torch.float32).clone()

    def _set_optimizer_step(self, step: torch.Tensor) -> None:
        for s in self._inner_optimizer_states():
            if "step" in s:
                s["step"] = step.clone() if isinstance(s["step"], torch.Tensor) else int(step)
