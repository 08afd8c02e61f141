"""DeepSpeed's working memory sized from the model, not from its GPU defaults.

DeepSpeed sizes its buffers for billion-parameter models on GPUs: reduce and all-gather buckets of
5·10⁸ elements (2 GB in fp32), ZeRO-3 prefetch of 5·10⁷ and up to 10⁹ live gathered elements kept
while they may be reused within 10⁹ elements. For any model below that size these mean "the
whole model": ZeRO-3 keeps every gathered parameter between forward and backward and the gradient
bucket holds every gradient, so ZeRO fitted a *smaller* model than DDP (bench_memory). plait sets
each from the number of elements ``Ψ`` this rank's part of the model has and its largest
parameter ``P`` (both counted on the unsplit model built on the meta device, divided by tp·pp, so
``plait plan`` shows the config the engine gets)::

    bucket B = min(max(Ψ / 32, P), 5·10⁸)       # a few percent of the model, at least one
                                                 # parameter, at most DeepSpeed's default
    stage 1-2:  reduce_bucket_size = allgather_bucket_size = B
    stage 3:    reduce_bucket_size = stage3_prefetch_bucket_size = B,
                stage3_max_live_parameters = stage3_max_reuse_distance = 2·B
                (gathered parameters are released unless reused within two buckets)

Measured (25.5M-parameter GPT, dp=4, fp32, CPU): ZeRO-3's peak above the pre-model memory falls
from 632 to ~400 MiB. Any of these keys in ``strategy.deepspeed.zero_optimization`` or
``strategy.config_file`` replaces plait's value; ``comm.bucket_mb`` sets ``reduce_bucket_size``.
"""

from __future__ import annotations

from typing import Any

import torch

DEEPSPEED_DEFAULT_BUCKET = 500_000_000
BUCKETS_PER_MODEL = 32


def working_memory_settings(model: torch.nn.Module, stage: int, model_parallel: int
                            ) -> dict[str, Any]:
    """The ``zero_optimization`` keys above for ``model`` (unsplit, any device) cut into
    ``model_parallel`` = tp·pp parts."""
    sizes = [p.numel() for p in model.parameters()]
    if stage == 0 or not sizes:
        return {}
    local = sum(sizes) // model_parallel
    bucket = int(min(max(local // BUCKETS_PER_MODEL, max(sizes)), DEEPSPEED_DEFAULT_BUCKET))
    if stage < 3:
        return {"reduce_bucket_size": bucket, "allgather_bucket_size": bucket}
    return {"reduce_bucket_size": bucket, "stage3_prefetch_bucket_size": bucket,
            "stage3_max_live_parameters": 2 * bucket, "stage3_max_reuse_distance": 2 * bucket}
