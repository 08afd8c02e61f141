"""The train loop: one worker process's whole run, as a sequence of hook calls.

Started by ``plait train`` in each worker (see ``plait.worker``). Everything that differs between
strategies happens inside the hooks; this file only fixes their order.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from omegaconf import DictConfig

from plait.config import job_last_step
from plait.meta import build_model, materialize
from plait.metrics import StepMeter
from plait.plugin_manager import PlaitPluginManager, check_engine
from plait.topology import TRAINER, Topology
from plait.types import Engine, TokenDataset, TrainState


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, -2), targets.flatten())


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def train(cfg: DictConfig, pm: PlaitPluginManager) -> dict | None:
    hook = pm.hook
    topology = hook.plait_build_topology(cfg=cfg) or Topology.initialize(
        cfg, assign_roles=lambda world_size: hook.plait_assign_roles(cfg=cfg, world_size=world_size)
    )
    seed_everything(cfg.seed)
    if topology.role != TRAINER:
        run_role(cfg, pm, topology)
        return None
    train_data = hook.plait_build_dataset(cfg=cfg, topology=topology, split="train")
    loader = hook.plait_shard_data(cfg=cfg, dataset=train_data, topology=topology)
    val_data = None
    if cfg.train.eval_every:
        val_data = hook.plait_build_dataset(cfg=cfg, topology=topology, split="val")

    engine, lr_at, meter = build_engine(cfg, hook, topology)

    # a replica group that rejoins takes a live peer's state instead of reading a checkpoint
    state = (
        hook.plait_sync_replicas(cfg=cfg, engine=engine, state=None, topology=topology)
        or hook.plait_load_checkpoint(cfg=cfg, engine=engine, topology=topology, hook=hook)
        or TrainState()
    )
    if state.data:
        loader.load_state_dict(state.data)
    logging = topology.is_logging_rank
    batches = iter(loader)
    last_step = job_last_step(cfg.train)
    checkpoint = None
    status = "failed"
    try:
        if logging:
            hook.plait_on_run_start(cfg=cfg, state=state, topology=topology)
        while state.step < last_step:
            received = hook.plait_sync_replicas(
                cfg=cfg, engine=engine, state=state, topology=topology
            )
            if received is not None:  # this group was behind: it continues from a peer's state
                state, batches = received, restart_batches(loader, batches, received)
            lr = lr_at(state.step)
            meter.start()
            micro_batches = next(batches)
            meter.data_ready()
            out = engine.train_step(micro_batches, lr=lr)
            if out.skipped:  # a guard refused the update on every rank: the batch is spent
                state.data = loader.state_dict()
                continue
            state.step += 1
            state.tokens_seen += meter.tokens_per_step
            state.data = loader.state_dict()
            final = state.step == last_step
            # a collective on logged steps
            metrics = meter.stop(state.step, out, lr, final, state.tokens_seen)
            if val_data is not None and (state.step % cfg.train.eval_every == 0 or final):
                metrics["eval/loss"] = evaluate(cfg, engine, val_data, topology)
            for scores in hook.plait_evaluate(
                cfg=cfg, engine=engine, state=state, topology=topology, final=final, hook=hook
            ):
                metrics.update(scores)  # downstream tasks (eval/<task>/<metric>)
            if logging:
                step_metrics = metrics or {
                    "loss": out.loss,
                    "lr": lr,
                    "grad_norm": out.grad_norm,
                    **out.metrics,
                }
                hook.plait_on_step_end(
                    step=state.step, output=out, state=state, metrics=step_metrics
                )
                if metrics:
                    state.metrics.update(metrics)
                    hook.plait_log_metrics(step=state.step, metrics=metrics, state=state)
            checkpoint = (
                hook.plait_save_checkpoint(
                    cfg=cfg, engine=engine, state=state, topology=topology, final=final, hook=hook
                )
                or checkpoint
            )
        status = "finished"
    except SystemExit as leaving:  # code 0: this worker leaves the job on purpose
        if leaving.code:
            hook.plait_on_failure(cfg=cfg, error=leaving, state=state)
        status = "failed" if leaving.code else "left"
        raise
    except BaseException as error:
        hook.plait_on_failure(cfg=cfg, error=error, state=state)
        raise
    finally:
        batches.close()  # stops the loader's background work before the process exits
        if logging:
            hook.plait_on_run_end(cfg=cfg, state=state, status=status)
    if not logging:
        return None
    return {"metrics": state.metrics, "checkpoint": str(checkpoint) if checkpoint else None}


def build_engine(
    cfg: DictConfig, hook, topology: Topology
) -> tuple[Engine, Callable[[int], float], StepMeter]:
    """This rank's engine, the learning rate by step and the meter of the steps, built by the
    hooks in the hook spec's order.

    Parallelize in a fixed order: tensor, expert and context parallel, activation checkpointing,
    pipeline stages, then the data-parallel engine (torchtitan's order). A model that initialises
    by name is cut on the meta device and only this rank's part is then given memory and values.
    The meter counts FLOPs on the whole model, before the split. (``scripts/bench_engine_ab.py``
    times this engine against a plain step.)
    """
    model, init = build_model(hook, cfg)
    meter = StepMeter(cfg, model, topology)
    hook.plait_apply_tensor_parallel(cfg=cfg, model=model, topology=topology)
    hook.plait_apply_expert_parallel(cfg=cfg, model=model, topology=topology)
    hook.plait_apply_context_parallel(cfg=cfg, model=model, topology=topology)
    hook.plait_apply_activation_checkpointing(cfg=cfg, model=model, topology=topology)
    model = hook.plait_split_pipeline(cfg=cfg, model=model, topology=topology) or model
    if init is not None:
        model = hook.plait_materialize_model(
            cfg=cfg, model=model, init=init, topology=topology
        ) or materialize(model, init, topology.device)
    loss_fn = hook.plait_build_loss(cfg=cfg, model=model, topology=topology) or cross_entropy
    optimizer = hook.plait_build_optimizer(cfg=cfg, model=model)
    lr_at = hook.plait_build_lr_schedule(cfg=cfg)
    engine = hook.plait_build_engine(
        cfg=cfg,
        model=model,
        optimizer=optimizer,
        loss_fn=loss_fn,
        grad_reducer=hook.plait_grad_reducer(cfg=cfg, topology=topology),
        topology=topology,
        hook=hook,
    )
    return check_engine(engine, hook), lr_at, meter  # the engine has its declared surfaces


def restart_batches(loader, batches, state: TrainState):
    """The loader's batches from ``state``'s data position on (the old ones stopped)."""
    batches.close()
    loader.load_state_dict(state.data)
    return iter(loader)


def run_role(cfg: DictConfig, pm: PlaitPluginManager, topology: Topology) -> None:
    """A rank that is not a trainer runs its plugin's loop (e.g. a parameter server)."""
    if not pm.hook.plait_run_role(cfg=cfg, topology=topology, hook=pm.hook):
        raise RuntimeError(
            f"rank {topology.rank} has role {topology.role!r}, which no active "
            "plugin runs (plait_run_role)"
        )


def evaluate(cfg: DictConfig, engine: Engine, data: TokenDataset, topology: Topology) -> float:
    """Mean loss over the first ``train.eval_batches`` global batches of the validation split."""
    ranks, rank = topology.dims.data_parallel, topology.data_parallel_rank
    micro = cfg.train.batch_size // ranks
    losses = []
    for k in range(cfg.train.eval_batches):
        start = ((k * ranks + rank) * micro) % max(len(data) - micro, 1)
        losses.append(engine.eval_loss(data.batch(list(range(start, start + micro)))))
    return sum(losses) / len(losses)
