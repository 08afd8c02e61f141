"""What each worker process runs: rebuild the plugin manager from the resolved config, train."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from omegaconf import OmegaConf

from plait.plugin_manager import keep_selected, make_plugin_manager
from plait.train import train


def run_worker(config: dict[str, Any], objects: tuple[Any, ...] = ()) -> None:
    """Entry point of one worker; ``config`` is the resolved config as a plain dict (picklable)."""
    cfg = OmegaConf.create(config)
    pm = keep_selected(make_plugin_manager(cfg, objects), cfg)
    try:
        train(cfg, pm)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
