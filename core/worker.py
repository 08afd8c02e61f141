"""What each worker process runs: rebuild the plugin manager from the resolved config, train."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from omegaconf import OmegaConf

from plait.plugin_manager import keep_selected, make_plugin_manager
from plait.train import train


def run_worker(config: dict[str, Any], objects: tuple[Any, ...] = ()) -> dict | None:
    """Entry point of one worker; ``config`` is the resolved config as a plain dict (picklable).

    :return: on the logging rank the run's summary (``metrics``: the last logged values,
        ``checkpoint``: the last checkpoint written), elsewhere None.
    """
    cfg = OmegaConf.create(config)
    OmegaConf.set_readonly(cfg, True)  # configured before launch: what differs per worker is in
    # the topology (e.g. an elastic job's accumulation at its present size: dims.grad_accum_steps)
    pm = keep_selected(make_plugin_manager(cfg, objects), cfg)
    try:
        return train(cfg, pm)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()

