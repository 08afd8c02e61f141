"""``tracker=wandb`` (the default): one Weights & Biases run per job, logged from rank 0.

Offline unless ``tracker.mode=online``; the run files land in ``run.dir/wandb``. The run config is
the resolved plait config. The run id is kept in the trainer state, so every checkpoint carries
it and a resumed job continues the same W&B run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from omegaconf import OmegaConf

from plait import hookimpl
from plait.config import TrackerConfig
from plait.types import PluginInfo


@dataclass
class WandbConfig(TrackerConfig):
    name: str = "wandb"
    project: str = "plait"
    entity: Optional[str] = None
    mode: str = "offline"  # offline | online | disabled
    group: Optional[str] = None
    tags: list[str] = field(default_factory=list)


class WandbTracker:
    def __init__(self) -> None:
        self.run = None

    @hookimpl
    def plait_declare(self) -> PluginInfo:
        return PluginInfo(name="wandb", selected_by={"tracker.name": "wandb"},
                          description="Weights & Biases tracking (offline by default)")

    @hookimpl
    def plait_register_configs(self, config_store) -> None:
        config_store.store(group="tracker", name="base_wandb", node=WandbConfig)

    @hookimpl
    def plait_validate(self, cfg) -> list[str]:
        if cfg.tracker.mode not in ("offline", "online", "disabled"):
            return [f"tracker.mode={cfg.tracker.mode}: choose offline, online or disabled"]
        return []

    @hookimpl
    def plait_on_run_start(self, cfg, state) -> None:
        import wandb

        t = cfg.tracker
        self.run = wandb.init(
            project=t.project, entity=t.entity, group=t.group, tags=list(t.tags), mode=t.mode,
            dir=cfg.run.dir, name=cfg.run.name, id=state.tracker_run_id, resume="allow",
            config=OmegaConf.to_container(cfg, resolve=True),
        )
        state.tracker_run_id = self.run.id

    @hookimpl
    def plait_log_metrics(self, step, metrics) -> None:
        self.run.log(metrics, step=step)

    @hookimpl
    def plait_on_run_end(self, status) -> None:
        if self.run is not None:
            self.run.finish(exit_code=0 if status == "finished" else 1)
            self.run = None


plugin = WandbTracker()
