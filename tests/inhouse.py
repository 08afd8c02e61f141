"""In-house plugins used by the tests, loaded the way users load theirs (dotted paths, objects)."""

from __future__ import annotations

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


crash_at_step_3 = CrashAtStep(3)
