"""ZeRO-3 without the whole model on any rank: each module's parameters are made (one full
parameter at a time, :mod:`plait.meta`) and partitioned over the data-parallel group at once,
before the next module's exist. A model that reads its values (a pretrained checkpoint) has
each rank read only its own partition instead (below).

This is what ``deepspeed.zero.Init`` does to a model constructed inside it, applied to a model
plait built on the meta device and has already cut (tensor parallelism): the first module's
parameters go through ``zero.Init(module=...)`` with the run's DeepSpeed config (it picks the
working dtype from ``bf16``/``fp16`` and the offload device), every later module's through the
``convert_to_zero_parameters`` DeepSpeed attaches to a partitioned parameter. ``deepspeed.
initialize`` then finds every parameter partitioned and converts nothing. Why not ``zero.Init``
around the constructor: the model's values come from a seed per parameter *name*, which a module
does not know while it is being constructed; and the same meta build serves every strategy.

Reading its partition: ``zero.Init`` broadcasts each parameter from the first dp rank before it
keeps the rank's flat partition, so every rank would hold every (tensor-parallel) parameter for a
moment. For a model that reads its values, the parameters are allocated without values instead,
converted and partitioned as ``zero.Init`` does it (its ``_convert_to_deepspeed_param`` and the
parameter's ``partition()``, without the broadcast: every rank reads the same file), and each rank
then reads the elements of its partition into ``ds_tensor``: ``[r·p, (r+1)·p)`` of the flattened
parameter, ``p = ceil(numel / dp)``, the padding zero (``init.flat``: only the rows holding them).
Not with ZeRO++'s secondary partition (``zero_hpz_partition_size``), which is cut from the whole
parameter: then the broadcast path is kept.
"""

from __future__ import annotations

import torch.nn as nn

from plait.meta import ParameterInit, materialize
from plait.plugins.zero.config import deepspeed_config
from plait.plugins.zero.engine import TopologyMPU


def materialize_partitioned(model: nn.Module, init: ParameterInit, cfg, topology) -> nn.Module:
    import deepspeed
    import torch.distributed as dist

    # deepspeed.initialize would do this later; zero.Init reads the world through it now
    deepspeed.init_distributed(dist_backend=dist.get_backend(), dist_init_required=False)
    mpu = TopologyMPU(topology)
    offload = cfg.strategy.offload_params
    partitioned: list[nn.Parameter] = []

    settings = dict(
        data_parallel_group=mpu.get_sequence_data_parallel_group(),
        config_dict_or_path=deepspeed_config(cfg, topology.dims),
        remote_device=None if offload == "none" else offload,
        mpu=mpu,
    )
    if init.read is not None:
        zero_init = deepspeed.zero.Init(module=nn.ParameterList(), **settings)
        if getattr(zero_init, "zero_param_process_group", None) is None:

            def read_partitions(module, params, origins) -> None:
                for p, (name, meta) in zip(params, origins):
                    zero_init._convert_to_deepspeed_param(p)
                    p.partition()
                    fill_partition(p, init.flat, name, meta)

            return materialize(
                model, init, topology.device, after_module=read_partitions, fill=False
            )

    def partition(module: nn.Module, params: list[nn.Parameter], origins) -> None:
        if partitioned:
            partitioned[0].convert_to_zero_parameters(param_list=params)
        else:  # exactly these parameters: a module's children may still be on the meta device
            deepspeed.zero.Init(module=nn.ParameterList(params), **settings)
        partitioned.extend(params[:1])

    return materialize(model, init, topology.device, after_module=partition)


def fill_partition(p: nn.Parameter, flat, name: str, meta: nn.Parameter) -> None:
    """Write this rank's elements of ``p`` into its partition ``p.ds_tensor`` (zero padding)."""
    import torch

    part = p.ds_tensor
    start = part.ds_numel * p.ds_zero_partition_rank
    stop = min(start + part.ds_numel, p.ds_numel)
    with torch.no_grad():
        if stop > start:
            part[: stop - start].copy_(flat(name, meta, start, stop))
        part[max(stop - start, 0) :].zero_()
