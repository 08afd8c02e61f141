"""Per-step figures: throughput, an MFU estimate, and per-rank time and memory as min/max.

Per-rank figures are reduced across all ranks so a straggler shows in the logged max while only
rank 0 logs.
"""

from __future__ import annotations

import resource
import time

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from plait.topology import Topology
from plait.types import StepOutput


def flops_per_token(cfg: DictConfig, n_params: int) -> float:
    """6·N for the weight matmuls (forward + backward) plus 12·L·H·Q·T for attention.

    The attention term uses the model's layers L, heads H, head size Q and the sequence length
    T when the model config has them (PaLM appendix B); a custom model gets 6·N alone.
    """
    m = cfg.model
    n_layer = OmegaConf.select(m, "n_layer", default=None)
    n_head = OmegaConf.select(m, "n_head", default=None)
    n_embd = OmegaConf.select(m, "n_embd", default=None)
    attention = 0
    if n_layer and n_head and n_embd:
        attention = 12 * n_layer * n_head * (n_embd // n_head) * cfg.train.seq_len
    return 6 * n_params + attention


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


class StepMeter:
    """Times each step and turns an engine's output into the logged metrics."""

    def __init__(self, cfg: DictConfig, n_params: int, topology: Topology):
        self.cfg = cfg
        self.topology = topology
        self.tokens_per_step = cfg.train.batch_size * cfg.train.seq_len
        self.flops_per_step = flops_per_token(cfg, n_params) * self.tokens_per_step
        self.peak_flops = cfg.train.peak_flops * topology.dims.world_size
        self._started = 0.0

    def start(self) -> None:
        self._started = time.perf_counter()

    def stop(self, step: int, out: StepOutput, lr: float) -> dict[str, float]:
        """Metrics for ``step``; empty on steps that are not logged. Collective on logged steps."""
        step_time = time.perf_counter() - self._started
        if step % self.cfg.train.log_every and step != self.cfg.train.steps:
            return {}
        memory = float(peak_memory_bytes(self.topology.device))
        # One MAX reduction gives both extremes: min(x) = -max(-x).
        figures = torch.tensor([step_time, memory, -step_time, -memory], dtype=torch.float64,
                               device=self.topology.device)
        dist.all_reduce(figures, op=dist.ReduceOp.MAX)
        highs, lows = figures[:2].tolist(), (-figures[2:]).tolist()
        slowest = highs[0]
        return {
            "loss": out.loss,
            "lr": lr,
            "grad_norm": out.grad_norm,
            "tokens_per_s": self.tokens_per_step / slowest,
            "mfu": self.flops_per_step / slowest / self.peak_flops,
            "step_time_s/min": lows[0],
            "step_time_s/max": slowest,
            "peak_memory_bytes/min": lows[1],
            "peak_memory_bytes/max": highs[1],
            **out.metrics,
        }
