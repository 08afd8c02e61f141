"""``comm.compression=fp16|bf16``: gradients cast to half precision for the wire, torch's own
``fp16_compress_hook`` / ``bf16_compress_hook`` (``ddp_comm_hooks/default_hooks.py``): divide by
the group size, cast, all-reduce over the given process group, cast back into the bucket in
place. Half the bytes of fp32 on every link; the sum is rounded to 11 (fp16) or 8 (bf16)
significant bits, and fp16's division first keeps the sum in range."""

from __future__ import annotations

from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

HOOKS = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}


def cast_hook(compression: str, group):
    """``(hook, state)`` in DDP's comm-hook form; ``group`` may be an algorithm's group."""
    return HOOKS[compression], group
