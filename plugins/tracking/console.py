"""Rank 0's console: a progress bar (steps, loss, tokens/s) on a terminal, plain log lines
otherwise (CI, files), so logs stay readable."""

from __future__ import annotations

import sys

from plait import hookimpl
from plait.topology import describe_nodes
from plait.types import PluginInfo


def format_metrics(step: int, total: int, metrics: dict[str, float]) -> str:
    line = (
        f"step {step}/{total} loss {metrics['loss']:.4f} lr {metrics['lr']:.2e} "
        f"grad_norm {metrics['grad_norm']:.3f} tok/s {metrics['tokens_per_s']:,.0f}"
    )
    if "mfu" in metrics:
        line += f" mfu {100 * metrics['mfu']:.2f}%"
    if "eval/loss" in metrics:
        line += f" eval_loss {metrics['eval/loss']:.4f}"
    return line


class Console:
    def __init__(self) -> None:
        self.bar = None
        self.total = 0
        self.prefix = ""  # replica groups as jobs of their own: each group's lines say whose

    @hookimpl
    def plait_declare(self) -> PluginInfo:
        return PluginInfo(name="console", description="progress bar or log lines on rank 0")

    @hookimpl
    def plait_on_run_start(self, cfg, state, topology) -> None:
        self.total = cfg.train.steps
        d = topology.dims
        group = ""
        if d.replica_groups > 1:
            self.prefix = f"replica group {topology.replica_group_id}: "
            group = f" in replica group {topology.replica_group_id} of {d.replica_groups}"
        print(
            f"plait: training {cfg.run.dir} from step {state.step} on {d.world_size} "
            f"process(es){group} (dp {d.dp} x tp {d.tp} x pp {d.pp}, {topology.device}, "
            f"{cfg.precision})",
            flush=True,
        )
        if d.nnodes > 1:  # the node layout the launcher gave, as `plait plan` forecast it
            print("\n".join(describe_nodes(d, topology.node_of, topology.roles)), flush=True)
        if sys.stderr.isatty() and not self.prefix:  # one bar per terminal
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, initial=state.step, unit="step", dynamic_ncols=True)

    @hookimpl
    def plait_log_metrics(self, step, metrics) -> None:
        if self.bar is None:
            print(self.prefix + format_metrics(step, self.total, metrics), flush=True)
            return
        self.bar.update(step - self.bar.n)
        self.bar.set_postfix(loss=f"{metrics['loss']:.4f}", tok_s=f"{metrics['tokens_per_s']:,.0f}")

    @hookimpl
    def plait_on_run_end(self, state, status) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        print(f"plait: {self.prefix}run {status} at step {state.step}", flush=True)


plugin = Console()
