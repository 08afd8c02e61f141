"""``strategy=ddp`` (the default): torch ``DistributedDataParallel`` over the data-parallel group
(with ``parallel.cp > 1`` the data- and context-parallel ranks together, as Megatron-core's DDP
reduces over ``data_parallel_group_with_context_parallel``: each rank's loss is the mean over its
tokens, all hold equally many, so the average over ``dp x cp`` is the batch's gradient).

Gradient accumulation skips the all-reduce on all but the last micro-batch (``no_sync``); the
gradient communication is the comm plugin's reducer, adapted as a DDP comm hook on DDP's buckets
(:func:`register_reducer`), and DDP's bucket size is the comm plugin's (``comm.bucket_mb``).
With ``precision=fp16`` torch's dynamic ``GradScaler`` scales the loss; the step logs
``loss_scale`` and ``skipped_steps`` (steps skipped on an overflow), as ``strategy=zero*`` does.
Under expert parallelism (``parallel.ep > 1``) DDP leaves this rank's experts alone; after the
last micro-batch their gradients are averaged over the expert-data-parallel group
(:mod:`plait.engine.experts`), and each (pp, tp, ep) position saves its own file.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from plait import hookimpl
from plait.config import StrategyConfig
from plait.engine.experts import average_expert_gradients, expert_names
from plait.engine.hyperparameters import keep_hyperparameters
from plait.engine.precision import grad_scaler_state, load_grad_scaler_state
from plait.engine.state_by_name import load_state_by_name, state_by_name
from plait.engine.step import TorchEngine
from plait.meta import parameters_per_rank
from plait.types import CommSpec, GradReducer, PluginInfo, StrategyCost


@dataclass
class DDPConfig(StrategyConfig):
    name: str = "ddp"
    compile: bool = False  # torch.compile the model, around DDP (DDP splits the graph per bucket)


def reduce_bucket(state, bucket):
    """A DDP comm hook that hands DDP's bucket to the comm plugin's reducer: ``state`` is
    ``(reducer, group)``, the result a future of the averaged bucket. (Unannotated: DDP compares
    the annotations with real types, and this module's are strings.)"""
    reducer, group = state
    return reducer.reduce(bucket, group)


def register_reducer(
    ddp: DistributedDataParallel, reducer: GradReducer | None, group: dist.ProcessGroup
) -> None:
    """Make DDP average its buckets with ``reducer``.

    Where the reducer is the strategy's own all-reduce (``spec.native``), DDP's C++ paths do the
    same with no Python per bucket: its built-in all-reduce, or for fp16 compression torch's
    built-in C++ fp16 hook (the C++ twin of ``fp16_compress_hook``). Everything else goes
    through the reducer.
    """
    if reducer is None or (reducer.spec.native and reducer.spec.compression == "none"):
        return
    if reducer.spec.native and reducer.spec.compression == "fp16":
        ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
        return
    ddp.register_comm_hook((reducer, group), reduce_bucket)


class CommHookReducer:
    """Hook spec 1.0's ``plait_comm_hook`` answer, a torch DDP comm hook ``(state, hook)``, as a
    :class:`plait.types.GradReducer` (deprecated since hook spec 1.1, kept until 2.0): ``reduce``
    calls ``hook(state, bucket)``; the bucket size stays the comm plugin's."""

    def __init__(self, state, hook, bucket_bytes: int | None):
        self.state, self.hook = state, hook
        self.spec = CommSpec(algorithm="comm_hook", bucket_bytes=bucket_bytes)

    def reduce(self, bucket, group):
        return self.hook(self.state, bucket)


def legacy_comm_hook(cfg, topology, grad_reducer: GradReducer | None, hook) -> GradReducer | None:
    """An in-house ``plait_comm_hook`` (hook spec 1.0) in place of the comm plugin's reducer."""
    answer = hook.plait_comm_hook(cfg=cfg, topology=topology)
    if answer is None:
        return grad_reducer
    state, comm_hook = answer
    bucket_bytes = grad_reducer.spec.bucket_bytes if grad_reducer is not None else None
    return CommHookReducer(state, comm_hook, bucket_bytes)


def ddp_options(reducer: GradReducer | None) -> dict:
    """DDP's constructor arguments that the comm plugin decides: the bucket size."""
    if reducer is None or reducer.spec.bucket_bytes is None:
        return {}
    return {"bucket_cap_mb": reducer.spec.bucket_bytes / 2**20}


class DDPEngine(TorchEngine):
    """The base step (:class:`plait.engine.step.TorchEngine`) with DDP's own parts: the model
    wrapped in ``DistributedDataParallel`` over the ``dp x cp`` group (experts left out), its
    all-reduce skipped on all but the last micro-batch (``no_sync``), and the experts' gradients
    averaged over their expert-data-parallel group after the last one."""

    def __init__(self, cfg, model, optimizer, loss_fn, grad_reducer, topology, hook):
        super().__init__(cfg, topology, hook, model.to(topology.device), optimizer, loss_fn)
        dp_group = topology.group("dp_cp")
        self.ep = topology.dims.ep
        self.edp_group = topology.group("edp")
        self.checkpoint_name = f"model_pp{topology.pp_rank}_tp{topology.tp_rank}.pt"
        self.saves_checkpoint = topology.dp_cp_rank == 0
        if self.ep > 1:  # one file per position holding other experts, from its first replica
            self.checkpoint_name = self.checkpoint_name.replace(".pt", f"_ep{topology.ep_rank}.pt")
            self.saves_checkpoint = topology.edp_rank == 0
        grad_reducer = legacy_comm_hook(cfg, topology, grad_reducer, hook)
        if self.loss_size > 1:
            if self.ep > 1:
                DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
                    model, expert_names(model)
                )
            device_ids = [self.device.index] if self.device.type == "cuda" else None
            self.wrapped = DistributedDataParallel(
                model, device_ids=device_ids, process_group=dp_group, **ddp_options(grad_reducer)
            )
            register_reducer(self.wrapped, grad_reducer, dp_group)
        if cfg.strategy.compile:  # compiled around DDP, so DDP's graph splitting applies
            self.wrapped = torch.compile(self.wrapped)

    def sync(self, last: bool):
        """DDP all-reduces on the last micro-batch only."""
        return contextlib.nullcontext() if last or self.loss_size == 1 else self.wrapped.no_sync()

    def reduce_gradients(self) -> None:
        if self.ep > 1:
            average_expert_gradients(self.model.parameters(), self.edp_group, self.loss_size)

    def save_state(self, directory: Path) -> None:
        if self.saves_checkpoint:
            torch.save(self.local_state(), directory / self.checkpoint_name)

    def load_state(self, directory: Path) -> None:
        self.load_local_state(
            torch.load(
                directory / self.checkpoint_name, map_location=self.device, weights_only=True
            )
        )

    def local_state(self) -> dict:
        """This rank's model, optimizer and loss scaler (what its checkpoint file holds; the
        state a recovering replica group takes from this rank, ``engine:replica_groups``)."""
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "skipped_steps": self.skipped_steps,
        }

    def load_local_state(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        with keep_hyperparameters(self.optimizer):
            self.optimizer.load_state_dict(state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])
        self.skipped_steps = state["skipped_steps"]

    def layout_free_state(self) -> dict:
        """Model and optimizer state by parameter name (DCP's ``get_state_dict``; see
        :mod:`plait.engine.layout_free`). A fresh optimizer's state is created
        first, so a resumed engine's own state can be the template DCP loads into. Under fp16
        the loss scaler's state too (also the pipeline engine's, which uses this scaler)."""
        state = state_by_name(self.model, self.optimizer)
        if self.scaler.is_enabled():
            state["loss_scale"] = {
                **grad_scaler_state(self.scaler),
                "skipped_steps": torch.tensor(self.skipped_steps),
            }
        return state

    def layout_free_shards(self) -> dict:
        """The same state: its tensors are the engine's own (DCP's ``get_state_dict`` returns
        them, not copies), each rank's tensor-parallel shard placed by the layout-free copy."""
        return self.layout_free_state()

    def load_layout_free_state(self, state: dict) -> None:
        load_state_by_name(self.model, self.optimizer, state)
        if "loss_scale" in state:
            load_grad_scaler_state(self.scaler, state["loss_scale"])
            self.skipped_steps = int(state["loss_scale"]["skipped_steps"])

    load_layout_free_shards = load_layout_free_state  # its state was read in place


@hookimpl
def plait_declare() -> PluginInfo:
    return PluginInfo(
        name="ddp",
        selected_by={"strategy.name": "ddp"},
        provides=frozenset(
            {
                "engine:tensor_parallel",
                "engine:pipeline",
                "engine:split_backward",
                "engine:grad_reducer",
                "engine:grad_comm",
                "engine:layout_free_state",
                "engine:comm_hook",
                "engine:expert_parallel",
                "engine:context_parallel",
                "engine:replica_groups",
            }
        ),
        description="torch DistributedDataParallel",
    )


@hookimpl
def plait_register_configs(config_store) -> None:
    config_store.store(group="strategy", name="base_ddp", node=DDPConfig)


@hookimpl
def plait_validate(cfg, dims) -> list[str]:
    if cfg.precision == "fp16" and dims.tp > 1:
        return [
            f"precision=fp16 with parallel.tp={dims.tp} and strategy=ddp: DDP's loss scaler "
            "checks overflow per rank, so tensor-parallel ranks could skip different steps; "
            "use precision=bf16 or fp32, or strategy=zero1 (DeepSpeed's scaler agrees "
            "across ranks)"
        ]
    return []


@hookimpl
def plait_replica_groups(cfg, dims) -> int | None:
    """Each dp rank is a whole model replica: a replica group of its tensor, pipeline and
    context-parallel ranks; under expert parallelism the ``ep`` dp ranks that hold the experts
    between them are one."""
    return dims.dp // dims.ep if cfg.strategy.name == "ddp" else None


@hookimpl
def plait_strategy_cost(strategy, model, dims) -> StrategyCost | None:
    """DDP with torch AdamW in any precision (autocast keeps parameters and gradients fp32):
    4 + 4 + 8 bytes per parameter, DDP's gradient buckets another 4 (copies of the gradients:
    ``gradient_as_bucket_view`` is off; none at dp·cp = 1, where nothing is wrapped: measured
    under tp=2 x pp=2 on 4 processes, counting them put the estimate 24% above the peak), and
    an all-reduce of the fp32 gradients per step over
    the ``dp x cp`` ranks (experts' over their expert-data-parallel group, counted here as over
    dp)."""
    if strategy != "ddp":
        return None
    psi = sum(parameters_per_rank(model, dims))
    n = dims.dp_cp
    return StrategyCost(
        params=4 * psi,
        grads=4 * psi,
        optimizer=8 * psi,
        buffers=4 * psi if n > 1 else 0,
        dp_bytes_per_step=2 * (n - 1) / n * psi * 4,
    )


@hookimpl
def plait_read_model_shards(checkpoint) -> dict[tuple[int, int], dict]:
    """Each (pp, tp) position's state dict; under expert parallelism the files of its ep ranks
    together (their experts have distinct global names)."""
    shards: dict[tuple[int, int], dict] = {}
    for path in sorted(checkpoint.glob("model_pp*_tp*.pt")):
        pp, tp = (int(part[2:]) for part in path.stem.split("_")[1:3])
        state = torch.load(path, map_location="cpu", weights_only=True)["model"]
        shards.setdefault((pp, tp), {}).update({k: v.float() for k, v in state.items()})
    return shards


@hookimpl
def plait_build_engine(cfg, model, optimizer, loss_fn, grad_reducer, topology, hook) -> DDPEngine:
    return DDPEngine(cfg, model, optimizer, loss_fn, grad_reducer, topology, hook)
