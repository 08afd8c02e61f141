"""Around the strategy's engine when the model has mixture-of-experts layers: each step sets the
layers' auxiliary-loss scale for the engine's micro-batches, and after a logged step (every
``train.log_every``-th and the last) sums their routing figures over every rank into its metrics
(W&B, ``metrics.jsonl``); other steps record no routing and time no all-to-all (issue 32).

Metrics (``T[l, e]``: tokens layer ``l`` computed on expert ``e`` in the step, global batch)::

    moe/tokens_per_expert_min, _max   min, max over every layer and expert of T[l, e]
    moe/imbalance                     max over layers of max_e T[l, e] / mean_e T[l, e] (1: even)
    moe/dropped_tokens                choices dropped by model.capacity_factor, all layers
    moe/aux_loss, moe/z_loss          the layers' mean unweighted load-balancing and z-loss
    moe/all_to_all_s                  seconds in all-to-all calls, the slowest rank (ep > 1)
    moe/all_to_all_bytes[_max]        bytes each rank sent to other ranks: mean, largest
    moe/all_to_all_calls              all-to-all calls of a rank in the step
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from plait.types import StepOutput


class MoEEngine:
    """The strategy's engine, with the mixture-of-experts bookkeeping around ``train_step``;
    everything else is the strategy engine's."""

    def __init__(self, engine, layers: list, topology, meter=None, logged=lambda step: True):
        self.engine, self.layers, self.meter = engine, layers, meter
        self.logged = logged  # whether a step is logged: its figures are gathered then only
        self.step = 0  # steps taken (the resumed step at the start: set by the plugin)
        self.counts_once = topology.tp_rank == 0  # tensor-parallel ranks route the same tokens
        self.group = topology.step_group
        self.world = len(topology.trainer_ranks)
        self.rows, self.n_experts = layers[0].stats_rows, layers[0].n_experts

    def train_step(self, micro_batches, lr: float) -> StepOutput:
        # An engine that backpropagates loss / m per micro-batch gets aux / m too; the pipeline
        # scales all gradients by 1 / m after its schedule instead.
        after = getattr(self.engine, "scales_grads_after_backward", False)
        scale = 1.0 if after else 1.0 / len(micro_batches)
        logged = self.logged(self.step + 1)  # routing figures and all-to-all timing: then only
        for layer in self.layers:
            layer.aux_loss_scale = scale
            layer.record_stats = logged
            layer.stats.reset()
        if self.meter is not None:
            self.meter.reset()
            self.meter.on = logged
        out = self.engine.train_step(micro_batches, lr)
        if not out.skipped:
            self.step += 1
        if logged:
            out.metrics.update(self.figures(len(micro_batches)))
        return out

    def figures(self, forwards: int) -> dict[str, float]:
        """The step's routing figures over all ranks (two small all-reduces, on every rank);
        each layer ran ``forwards`` training forwards here."""
        E = self.n_experts
        table = torch.zeros(self.rows, E + 4, dtype=torch.float64)
        if self.counts_once:
            for layer in self.layers:
                rows = layer.stats.last(forwards)
                if rows:
                    table[layer.stats_row, : E + 3] = torch.stack(rows).sum(dim=0)
                    table[layer.stats_row, E + 3] = len(rows)
        meter = self.meter
        sent = torch.tensor(
            [meter.bytes_sent, meter.seconds, meter.calls] if meter else [0, 0, 0],
            dtype=torch.float64,
        )
        table, total, peak = self._reduce(table, sent)
        tokens = table[:, :E]
        forwards = table[:, E + 3].clamp(min=1)
        mean = tokens.mean(dim=1).clamp(min=1e-12)
        figures = {
            "moe/tokens_per_expert_min": tokens.min().item(),
            "moe/tokens_per_expert_max": tokens.max().item(),
            "moe/imbalance": (tokens.max(dim=1).values / mean).max().item(),
            "moe/dropped_tokens": table[:, E].sum().item(),
            "moe/aux_loss": (table[:, E + 1] / forwards).mean().item(),
            "moe/z_loss": (table[:, E + 2] / forwards).mean().item(),
        }
        if meter is not None:
            figures.update(
                {
                    "moe/all_to_all_bytes": total[0].item() / self.world,
                    "moe/all_to_all_bytes_max": peak[0].item(),
                    "moe/all_to_all_s": peak[1].item(),
                    "moe/all_to_all_calls": peak[2].item(),
                }
            )
        return figures

    def _reduce(self, table: torch.Tensor, sent: torch.Tensor):
        if not dist.is_initialized() or self.world == 1:
            return table, sent, sent
        device = self._device()
        summed = torch.cat([table.flatten(), sent]).to(device)
        dist.all_reduce(summed, group=self.group)
        peak = sent.to(device)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=self.group)
        summed, peak = summed.cpu(), peak.cpu()
        return summed[: table.numel()].view_as(table), summed[table.numel() :], peak

    def _device(self) -> torch.device:
        backend = dist.get_backend(self.group)
        return (
            torch.device("cuda", torch.cuda.current_device())
            if backend == "nccl"
            else torch.device("cpu")
        )

    def __getattr__(self, name):
        return getattr(self.engine, name)
