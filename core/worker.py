"""What each worker process runs: rebuild the plugin manager from the resolved config, train."""

from __future__ import annotations

import warnings
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
    show_each_warning_once()
    cfg = OmegaConf.create(config)
    OmegaConf.set_readonly(cfg, True)  # configured before launch: what differs per worker is in
    # the topology (e.g. an elastic job's accumulation at its present size: dims.grad_accum_steps)
    pm = keep_selected(make_plugin_manager(cfg, objects), cfg)
    try:
        return train(cfg, pm)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def show_each_warning_once() -> None:
    """Show each distinct warning (message, category, where) once in this process.

    Python's ``default`` action shows a warning once per location, but forgets what it showed
    whenever any code changes the warning filters (every ``warnings.catch_warnings`` block), and
    torch and DeepSpeed enter such blocks on hot paths. So a deprecation raised inside a library's
    step (DeepSpeed ZeRO-3 calling ``all_gather_into_tensor``, which torch 2.13 deprecates)
    printed on every step of every rank. Filters still apply (an ignored warning stays hidden,
    ``error`` still raises); only a repeat of a warning already shown is dropped.
    """
    show = warnings.showwarning
    if getattr(show, "plait_once", False):
        return
    shown: set[tuple[str, type, str, int]] = set()

    def show_once(message, category, filename, lineno, file=None, line=None):
        key = (str(message), category, filename, lineno)
        if key not in shown:
            shown.add(key)
            show(message, category, filename, lineno, file, line)

    setattr(show_once, "plait_once", True)
    warnings.showwarning = show_once
