"""``tracker=wandb`` (the default): one Weights & Biases run per job, logged from rank 0.

Offline unless ``tracker.mode=online``; the run files land in ``run.dir/wandb``. The run config is
the resolved plait config. The run id is kept in the trainer state, so every checkpoint carries
it and a resumed job continues the same W&B run. A run started from another run's checkpoint
(``TrainState.parent``) is a new W&B run whose config and notes name its parent. The jobs of a
sweep (``plait train -m``) are grouped by the sweep (``group``), with ``job_type`` "trial".
Where the replica groups run as torch jobs of their own (``fault=torchft``), replica group 0
tracks the run (the others log to their own metrics files).

``wandb.init`` (1-2 s: W&B's service started, and Python work: its settings, W&B Launch's
inputs, the list of installed packages) runs on a thread of its own beside the first steps, not
before them (issue 32: it was most of what plait's defaults add to the time to the first step).
W&B is imported there too (1.3 s of CPU with Launch's inputs), not declared for the launcher's
worker server to preload: the server's imports come before every worker's first step, the
thread's beside them (ddp+defaults' first step 1.2 s sooner here, by the medians of 12 pairs).
The run id is made up front, so the trainer state and every checkpoint carry it from the start;
metrics logged before the run is up are held, then logged in order with the times they were
logged at. An init that fails fails the run at the next logged step (or at its end).
"""

from __future__ import annotations

import hashlib
import multiprocessing
import multiprocessing.util
import secrets
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
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
    group: Optional[str] = None  # None: the sweep this run is a job of (run.sweep)
    job_type: Optional[str] = None  # None: "trial" in a sweep
    tags: list[str] = field(default_factory=list)


def replica_run_id(cfg, topology) -> str | None:
    """Where the replica groups run as torch jobs of their own (``fault=torchft``), the W&B run
    of group 0 has an id derived from the run directory: a group 0 that restarts and recovers
    from a peer (which never tracked, so carries no id) continues the same W&B run. None
    otherwise (W&B picks one, kept in the checkpoints)."""
    if topology.dims.replica_groups == 1:
        return None
    return hashlib.sha1(str(Path(cfg.run.dir).resolve()).encode()).hexdigest()[:16]


def init_wandb(**settings):
    """``wandb.init``, imported here: on the init's own thread."""
    imported_here = "wandb" not in sys.modules
    import wandb

    if imported_here:
        remove_import_dirs_at_worker_exit()
    return wandb.init(**settings)


# The temporary directories W&B makes when imported, as (module, attribute); wandb 0.31's
# names (older and newer versions may lack one: it is skipped).
IMPORT_DIRS = (
    ("wandb.sdk.data_types._private", "MEDIA_TMP"),  # tmp*wandb-media
    ("wandb.sdk.artifacts.artifact", "Artifact._TMP_DIR"),  # tmp*wandb-artifacts
)


def remove_import_dirs_at_worker_exit() -> None:
    """W&B makes two temporary directories when it is imported and removes them with
    ``atexit``; a worker the launcher forked ends with ``os._exit``, which runs no ``atexit``
    handler, so every tracked run left both behind. Such a worker does run ``multiprocessing``'s
    exit finalizers: their removal is registered there. Only for a W&B this process imported
    (one inherited from the process it was forked from shares its directories)."""
    if multiprocessing.parent_process() is None:
        return  # not a multiprocessing child: the process's own exit runs W&B's atexit
    for module_name, attribute in IMPORT_DIRS:
        found = sys.modules.get(module_name)
        for name in attribute.split("."):
            found = getattr(found, name, None)
        if found is not None:
            multiprocessing.util.Finalize(None, found.cleanup, exitpriority=0)


class WandbTracker:
    def __init__(self) -> None:
        self.run = None
        self.starting: Future | None = None  # wandb.init on its own thread
        self.held: list[tuple[int, dict]] = []  # (step, metrics) logged before the run was up

    @hookimpl
    def plait_declare(self) -> PluginInfo:
        return PluginInfo(
            name="wandb",
            selected_by={"tracker.name": "wandb"},
            description="Weights & Biases tracking (offline by default)",
        )

    @hookimpl
    def plait_register_configs(self, config_store) -> None:
        config_store.store(group="tracker", name="base_wandb", node=WandbConfig)

    @hookimpl
    def plait_validate(self, cfg) -> list[str]:
        if cfg.tracker.mode not in ("offline", "online", "disabled"):
            return [f"tracker.mode={cfg.tracker.mode}: choose offline, online or disabled"]
        return []

    @hookimpl
    def plait_on_run_start(self, cfg, state, topology) -> None:
        if topology.replica_group_id != 0:
            return  # replica groups as jobs of their own: group 0 tracks the run
        t = cfg.tracker
        config = OmegaConf.to_container(cfg, resolve=True)
        notes = None
        if state.parent:  # started from another run's checkpoint: a new run naming its parent
            config["parent"] = state.parent
            notes = (
                f"continues {state.parent['run_name']} (W&B run "
                f"{state.parent['tracker_run_id']}) from its step {state.parent['step']}"
            )
        in_sweep = cfg.run.sweep is not None
        # 8 lowercase hex digits: the length of W&B's own ids, within its alphabet
        state.tracker_run_id = (
            state.tracker_run_id or replica_run_id(cfg, topology) or secrets.token_hex(4)
        )
        starter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="plait-wandb-init")
        self.starting = starter.submit(
            init_wandb,
            project=t.project,
            entity=t.entity,
            group=t.group or cfg.run.sweep,
            job_type=t.job_type or ("trial" if in_sweep else None),
            tags=list(t.tags),
            mode=t.mode,
            dir=cfg.run.dir,
            name=cfg.run.name,
            notes=notes,
            id=state.tracker_run_id,
            resume="allow",
            config=config,
        )
        starter.shutdown(wait=False)

    def _run_up(self):
        """The W&B run, waiting for its init if need be; the held metrics logged first."""
        if self.run is None:
            self.run = self.starting.result()  # raises what wandb.init raised
            for step, metrics in self.held:
                self.run.log(metrics, step=step)
            self.held.clear()
        return self.run

    @hookimpl
    def plait_log_metrics(self, step, metrics) -> None:
        if self.starting is None:
            return
        if self.run is None and not self.starting.done():
            # W&B keeps a row's own ``_timestamp``: held rows keep the time they were logged
            self.held.append((step, {**metrics, "_timestamp": time.time()}))
            return
        self._run_up().log(metrics, step=step)

    @hookimpl
    def plait_on_run_end(self, status) -> None:
        if self.starting is None:
            return
        ok = status in ("finished", "left")
        if not ok and self.starting.exception() is not None:
            self.starting = None  # the run's own error is the one to show
            return
        self._run_up().finish(exit_code=0 if ok else 1)
        self.run, self.starting = None, None


plugin = WandbTracker()
