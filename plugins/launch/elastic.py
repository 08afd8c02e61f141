"""What an elastic job (``launcher.nnodes=MIN:MAX``) reports each time its group forms.

torch elastic re-forms the group after a node leaves (a restart) or joins (a membership
change); every re-formed group starts the workers afresh, so the train loop's start is the point
where the new size is known. The logging rank prints the size the group formed at and the
accumulation that keeps ``train.batch_size``, and every logged step carries them as metrics
(``nodes``, ``world_size``, ``dp``, ``grad_accum_steps``), so W&B shows where the size changed.
A job of fixed size reports nothing here.
"""

from __future__ import annotations

from plait import hookimpl
from plait.types import PluginInfo


class ElasticReport:
    def __init__(self) -> None:
        self.figures: dict[str, float] = {}

    @hookimpl
    def plait_declare(self) -> PluginInfo:
        return PluginInfo(
            name="elastic_report",
            description="with launcher.nnodes=MIN:MAX: log the size each re-formed "
            "group runs at and the accumulation that keeps the batch",
        )

    @hookimpl
    def plait_on_run_start(self, cfg, state, topology) -> None:
        dims = topology.dims
        if not dims.elastic:
            return
        self.figures = {
            "nodes": float(dims.nnodes),
            "world_size": float(dims.world_size),
            "dp": float(dims.dp),
            "grad_accum_steps": float(dims.grad_accum_steps),
        }
        print(
            f"plait: elastic group of {dims.nnodes} node(s) (launcher.nnodes="
            f"{cfg.launcher.nnodes}): world size {dims.world_size}, dp {dims.dp}, "
            f"grad_accum_steps {dims.grad_accum_steps}, train.batch_size "
            f"{cfg.train.batch_size} kept; continuing at step {state.step}",
            flush=True,
        )

    @hookimpl(wrapper=True)
    def plait_log_metrics(self, metrics):
        metrics.update(self.figures)
        return (yield)


plugin = ElasticReport()
