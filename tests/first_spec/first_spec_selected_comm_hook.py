"""FROZEN: an in-house comm plugin written against hook spec 1.0 (plait 0.1), selected by its own
comm.name (comm.name=inhouse_fp16) rather than always on: fp16 compression through a DDP comm
hook, counting its calls. Do not edit: it must keep working for the life of hook spec major
version 1."""

import os

import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

from plait import hookimpl
from plait.types import PluginInfo


def counting_fp16_hook(state, bucket):
    with open(f"{os.environ['FIRST_SPEC_CALLS']}.{dist.get_rank()}", "a") as f:
        f.write(f"{bucket.index()}\n")
    return fp16_compress_hook(state, bucket)


@hookimpl
def plait_declare():
    return PluginInfo(name="inhouse_fp16", selected_by={"comm.name": "inhouse_fp16"})


@hookimpl
def plait_comm_hook(cfg, topology):
    return topology.get_data_parallel_group(), counting_fp16_hook
