"""In-house plugins used by the tests, loaded the way users load theirs (dotted paths, objects)."""

from __future__ import annotations

import json
from pathlib import Path

from plait import hookimpl
from plait.types import PluginInfo


class CrashAtStep:
    """Raises in the train loop after step ``step`` has been checkpointed or not (a real crash)."""

    def __init__(self, step: int):
        self.step = step

    @hookimpl
    def plait_declare(self):
        return PluginInfo(name="crash_at_step")

    @hookimpl
    def plait_on_step_end(self, step):
        if step == self.step:
            raise RuntimeError(f"injected crash at step {step}")


class FancyEngine:
    """A second plugin deciding plait_build_engine: must conflict with ddp."""

    @hookimpl
    def plait_declare(self):
        return PluginInfo(name="fancy_engine")

    @hookimpl
    def plait_build_engine(self, cfg):
        raise AssertionError("never built: the plan is refused first")


class Fp32Only:
    @hookimpl
    def plait_declare(self):
        return PluginInfo(name="fp32_only", precisions=frozenset({"fp32"}),
                          parallel_axes=frozenset({"dp"}))


class RecordPlacement:
    """Writes, on every rank, where the strategy's engine put the model and the process group's
    backend and size: ``placement_rank<r>.json`` in ``directory``."""

    def __init__(self, directory):
        self.directory = str(directory)

    @hookimpl
    def plait_declare(self):
        return PluginInfo(name="record_placement")

    @hookimpl(wrapper=True)
    def plait_build_engine(self, topology):
        import torch.distributed as dist

        engine = yield
        record = {"rank": topology.rank, "local_rank": topology.local_rank,
                  "device": str(next(engine.model.parameters()).device),
                  "backend": dist.get_backend(), "world_size": dist.get_world_size()}
        Path(self.directory, f"placement_rank{topology.rank}.json").write_text(json.dumps(record))
        return engine


def read_placements(directory) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(Path(directory).glob("placement_rank*.json"))]


crash_at_step_3 = CrashAtStep(3)


class OptimizerSettingsAfterLoad:
    """Writes the settings of every param group of the optimizer that steps, right after the
    checkpoint is loaded, to ``run.dir/optimizer_after_load.json`` (rank 0)."""

    @hookimpl
    def plait_declare(self):
        return PluginInfo(name="optimizer_settings_after_load")

    @hookimpl(wrapper=True)
    def plait_load_checkpoint(self, cfg, engine, topology):
        import json
        from pathlib import Path

        state = yield
        optimizer = engine.ds.optimizer if hasattr(engine, "ds") else engine.optimizer
        groups = [{k: v for k, v in g.items() if k in ("lr", "betas", "weight_decay", "eps")}
                  for g in optimizer.param_groups]
        if topology.rank == 0:
            Path(cfg.run.dir, "optimizer_after_load.json").write_text(json.dumps(groups))
        return state
