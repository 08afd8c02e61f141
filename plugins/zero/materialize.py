"""ZeRO-3 without the whole model on any rank: each module's parameters are made (one full
parameter at a time, :mod:`plait.meta`) and partitioned over the data-parallel group at once,
before the next module's exist.

This is what ``deepspeed.zero.Init`` does to a model constructed inside it, applied to a model
plait built on the meta device and has already cut (tensor parallelism): the first module's
parameters go through ``zero.Init(module=...)`` with the run's DeepSpeed config (it picks the
working dtype from ``bf16``/``fp16`` and the offload device), every later module's through the
``convert_to_zero_parameters`` DeepSpeed attaches to a partitioned parameter. ``deepspeed.
initialize`` then finds every parameter partitioned and converts nothing. Why not ``zero.Init``
around the constructor: the model's values come from a seed per parameter *name*, which a module
does not know while it is being constructed; and the same meta build serves every strategy.
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

    def partition(module: nn.Module, params: list[nn.Parameter]) -> None:
        if partitioned:
            partitioned[0].convert_to_zero_parameters(param_list=params)
        else:  # exactly these parameters: a module's children may still be on the meta device
            deepspeed.zero.Init(module=nn.ParameterList(params),
                                data_parallel_group=mpu.get_sequence_data_parallel_group(),
                                config_dict_or_path=deepspeed_config(cfg, topology.dims),
                                remote_device=None if offload == "none" else offload, mpu=mpu)
        partitioned.extend(params[:1])

    return materialize(model, init, topology.device, after_module=partition)

