"""Per-step figures: throughput, MFU, and per-rank time and memory as min/max.

Per-rank figures are reduced across the trainers that step together (``topology.step_group``)
so a straggler shows in the logged max while only the logging rank logs.
"""

from __future__ import annotations

import pickle
import resource
import time

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from plait.topology import Topology
from plait.types import StepOutput

# One rank's pickled figures in a logged step's all-gather (a GPT's are about 1 KiB; more
# go through all_gather_object)
GATHER_BYTES = 8192

# Dense bf16 peak FLOP/s of one device, by the name CUDA reports (vendor data sheets).
PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100 SXM": 989e12,  # "NVIDIA H100 80GB HBM3"
    "H100 80GB HBM3": 989e12,
    "H100 NVL": 835e12,
    "H100 PCIe": 756e12,
    "H100": 756e12,  # an H100 of another form factor: the lowest figure
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 70e12,
}


def flops_per_token(model: torch.nn.Module, seq_len: int) -> float:
    """The model's own count (``model.flops_per_token(seq_len)``), else 6·N: two FLOPs per
    parameter per token forward, four backward."""
    count = getattr(model, "flops_per_token", None)
    if callable(count):
        return float(count(seq_len))
    return 6.0 * sum(p.numel() for p in model.parameters())


def device_peak_flops(device: torch.device) -> float | None:
    """The dense bf16 peak of a known GPU; None elsewhere (a CPU's peak is not knowable here)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, peak in PEAK_BF16_FLOPS.items():  # most specific names first
        if key in name:
            return peak
    return None


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


class StepMeter:
    """Times each step and turns an engine's output into the logged metrics.

    Per rank it sums, over the steps since the last logged step, its step time, its data wait
    and the phase times the engine's output carries (``StepOutput.timings``, which an engine may
    report on some steps only: the mean is over the steps that reported it); a logged step
    gathers every rank's means and peak memory in one all-gather over ``topology.step_group``
    (no collective on other steps), logged as ``<figure>/rank<r>`` beside the min/max of the
    logged step itself::

        step_time_s/rank<r> = (1/n) sum_{the n steps since the last logged one} step time of rank r
    """

    def __init__(self, cfg: DictConfig, model: torch.nn.Module, topology: Topology):
        self.cfg = cfg
        self.topology = topology
        self.tokens_per_step = cfg.train.batch_size * cfg.train.seq_len
        self.flops_per_step = flops_per_token(model, cfg.train.seq_len) * self.tokens_per_step
        peak = cfg.train.peak_flops or device_peak_flops(topology.device)
        self.peak_flops = peak * topology.dims.world_size if peak else None
        self._started = self._data_ready = 0.0
        self._sums: dict[str, float] = {}
        self._counts: dict[str, int] = {}  # steps that reported each figure

    def start(self) -> None:
        self._started = time.perf_counter()

    def data_ready(self) -> None:
        """The step's batches are in hand: the time since ``start`` was spent waiting for data."""
        self._data_ready = time.perf_counter()

    def stop(
        self, step: int, out: StepOutput, lr: float, last: bool, tokens_seen: int | None = None
    ) -> dict[str, float]:
        """Metrics for ``step``; empty on steps that are not logged (every ``train.log_every``
        and the ``last`` of the job). Collective on logged steps."""
        step_time = time.perf_counter() - self._started
        data_wait = self._data_ready - self._started
        for name, seconds in {
            "step_time_s": step_time,
            "data_wait_s": data_wait,
            **out.timings,
        }.items():
            self._sums[name] = self._sums.get(name, 0.0) + seconds
            self._counts[name] = self._counts.get(name, 0) + 1
        if step % self.cfg.train.log_every and not last:
            return {}
        mine = {
            "step_time_s": step_time,
            "data_wait_s": data_wait,
            "peak_memory_bytes": float(peak_memory_bytes(self.topology.device)),
            "means": {name: total / self._counts[name] for name, total in self._sums.items()},
        }
        self._sums, self._counts = {}, {}
        figures = self._gather(mine)
        step_times = [f["step_time_s"] for f in figures.values()]
        memories = [f["peak_memory_bytes"] for f in figures.values()]
        slowest = max(step_times)
        metrics = {
            "loss": out.loss,
            "lr": lr,
            "grad_norm": out.grad_norm,
            "tokens_per_s": self.tokens_per_step / slowest,
            "step_time_s/min": min(step_times),
            "step_time_s/max": slowest,
            "peak_memory_bytes/min": min(memories),
            "peak_memory_bytes/max": max(memories),
            "data_wait_s/max": max(f["data_wait_s"] for f in figures.values()),
            **out.metrics,
        }
        if tokens_seen is not None:
            metrics["tokens"] = float(tokens_seen)
        if self.peak_flops:
            metrics["mfu"] = self.flops_per_step / slowest / self.peak_flops
        for rank, rank_figures in figures.items():
            metrics[f"peak_memory_bytes/rank{rank}"] = rank_figures["peak_memory_bytes"]
            for name, value in sorted(rank_figures["means"].items()):
                metrics[f"{name}/rank{rank}"] = value
        return metrics

    def _gather(self, mine: dict) -> dict[int, dict]:
        """Every rank's figures by global rank (one all-gather over the step group). Objects,
        not a tensor of figures: ranks may time different phases (a pipeline stage, an
        offloading optimizer). Each rank's pickled figures travel in a buffer of the same fixed
        size (:data:`GATHER_BYTES`), so one all-gather does it where ``all_gather_object`` needs
        two (the sizes first); a rank whose figures do not fit says so in its buffer's header
        and every rank then gathers objects."""
        group = self.topology.step_group
        ranks = (
            dist.get_process_group_ranks(group)
            if group is not None
            else list(range(dist.get_world_size()))
        )
        payload = pickle.dumps(mine)
        device = dist.distributed_c10d._get_object_coll_device(group)
        buffer = torch.zeros(GATHER_BYTES, dtype=torch.uint8)
        fits = len(payload) <= GATHER_BYTES - 8
        buffer[:8] = torch.tensor([len(payload) if fits else -1]).view(torch.uint8)
        if fits:
            buffer[8 : 8 + len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        buffer = buffer.to(device)
        gathered = [torch.empty_like(buffer) for _ in ranks]
        dist.all_gather(gathered, buffer, group=group)
        rows: list = []
        for row in (g.cpu() for g in gathered):
            size = int(row[:8].view(torch.int64))
            if size < 0:  # some rank's figures are too large for the buffer
                rows = [None] * len(ranks)
                dist.all_gather_object(rows, mine, group=group)
                break
            rows.append(pickle.loads(row[8 : 8 + size].numpy().tobytes()))
        return dict(zip(ranks, rows))
