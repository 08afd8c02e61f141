"""``strategy=zero0|zero1|zero2|zero3``: DeepSpeed ZeRO (the real library, ``deepspeed.initialize``).

    plait train strategy=zero3 strategy.offload_optimizer=cpu precision=bf16
    plait plan strategy=zero2            # shows the generated DeepSpeed config
    plait estimate strategy=zero3 launcher.nproc_per_node=8 model=gpt2_small
    plait import-deepspeed ds_config.json  # the overrides equivalent to a DeepSpeed JSON

The DeepSpeed config is generated from plait's settings (``config.py``); the engine
(``engine.py``) runs DeepSpeed's forward/backward/step loop with plait's LR schedule and the
data-parallel group of plait's topology; ``estimate.py`` predicts and measures model-state bytes;
``export.py`` reads checkpoints back through DeepSpeed's zero-to-fp32 path;
``import_deepspeed.py`` translates a DeepSpeed JSON into plait overrides. DeepSpeed itself is
imported only inside the functions that run it, so ``plait plan`` stays fast.
"""

from __future__ import annotations

import functools
from pathlib import Path

from plait import hookimpl
from plait.meta import meta_model
from plait.plugins.zero import config as zero_config
from plait.types import PluginInfo


@hookimpl
def plait_declare() -> PluginInfo:
    return PluginInfo(
        name="zero",
        selected_by={"strategy.name": tuple(zero_config.STAGES)},
        preload=frozenset({"deepspeed", "plait.plugins.zero.preload"}),
        provides=frozenset(
            {
                "engine:tensor_parallel",
                "engine:grad_comm",
                "engine:pipeline",
                "engine:pipeline_step",
                "engine:split_backward",
                "engine:layout_free_state",
                "engine:expert_parallel",
                "engine:context_parallel",
            }
        ),
        description="DeepSpeed ZeRO stages 0-3, offload, bf16/fp16",
    )


@hookimpl
def plait_register_configs(config_store) -> None:
    config_store.store(group="strategy", name="base_zero", node=zero_config.ZeroStrategyConfig)


@hookimpl
def plait_register_commands(register) -> None:
    from plait.plugins.zero.import_deepspeed import cmd_import_deepspeed

    register(
        "import-deepspeed",
        cmd_import_deepspeed,
        "print the plait overrides equivalent to a DeepSpeed JSON config",
    )


@hookimpl
def plait_configure(cfg) -> None:
    # Workers may start elsewhere: pin the user's DeepSpeed JSON to an absolute path.
    if cfg.strategy.config_file:
        cfg.strategy.config_file = str(Path(cfg.strategy.config_file).expanduser().absolute())


@hookimpl
def plait_validate(cfg, dims, hook) -> list[str]:
    return zero_config.validate(cfg, dims, hook.plait_comm_spec(cfg=cfg))


@hookimpl
def plait_backend_config(cfg, dims, hook) -> dict:
    comm = hook.plait_comm_spec(cfg=cfg)
    if zero_config.validate(cfg, dims, comm):
        return {}
    ds = zero_config.deepspeed_config(cfg, dims, comm, meta_model(hook, cfg))
    mapped = {
        owner: {key: zero_config.flatten(ds)[key]}
        for key, owner in zero_config.comm_config(cfg, dims, comm)[1].items()
    }
    return {"deepspeed": ds, **({"deepspeed (from comm)": mapped} if mapped else {})}


@hookimpl
def plait_materialize_model(cfg, model, init, topology):
    """ZeRO-3 partitions the parameters as they are made (``materialize.py``); the other
    stages hold whole parameters: the core makes them."""
    if zero_config.stage_of(cfg) != 3:
        return None
    from plait.plugins.zero.materialize import materialize_partitioned

    return materialize_partitioned(model, init, cfg, topology)


@hookimpl
def plait_strategy_cost(cfg, strategy, model, dims):
    if strategy not in zero_config.STAGES:
        return None
    from plait.plugins.zero.estimate import strategy_cost

    return strategy_cost(cfg, strategy, model, dims)


@hookimpl
def plait_build_engine(cfg, model, optimizer, loss_fn, grad_reducer, topology, hook):
    """DeepSpeed reduces the gradients itself: the comm plugin's reducer is not called, its
    spec is mapped onto DeepSpeed's settings (``comm.py``). The step guards
    (``plait_check_step``) are asked inside DeepSpeed's step (``guard.py``)."""
    from plait.plugins.zero.engine import ZeroEngine

    comm = grad_reducer.spec if grad_reducer is not None else None
    ds_config = zero_config.engine_config(
        cfg, topology.dims, optimizer, comm, meta_model(hook, cfg)
    )
    check_step = functools.partial(hook.plait_check_step, cfg=cfg, topology=topology)
    return ZeroEngine(model, optimizer, loss_fn, topology, ds_config, check_step)


@hookimpl
def plait_read_model_shards(cfg, checkpoint) -> dict[tuple[int, int], dict]:
    from plait.plugins.zero.export import read_model_shards

    return read_model_shards(Path(checkpoint), zero_config.stage_of(cfg))
