"""Compose the config once and check the whole plan before any process starts.

A plan is the composed config, the plugins it selects, the process layout and the backend
configs the plugins generate. Every problem found (core rules, plugin capabilities, conflicting
decisions, plugin-specific validation) is collected, so the user sees all of them at once.
"""

from __future__ import annotations

import os
import secrets
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
from hydra import version
from hydra._internal.hydra import Hydra
from hydra._internal.utils import create_config_search_path
from hydra.core.config_search_path import SearchPathQuery
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import MissingConfigException
from omegaconf import DictConfig, OmegaConf, open_dict

from plait.composed import COMPOSED
from plait.config import (
    ACTIVATION_CHECKPOINTING,
    AT_LEAST_1,
    POSITIVE,
    PRECISIONS,
    NodeRange,
    Range,
    SchemaStore,
    node_range,
    range_problems,
    store_core_schemas,
)
from plait.host_memory import DECOMMIT_ABOVE, allocator_problems
from plait.plugin_manager import (
    PlaitPluginManager,
    broken_problems,
    check_conflicts,
    deciders,
    keep_selected,
    make_plugin_manager,
    offered_by,
)
from plait.renames import rename_overrides, renamed_settings
from plait.topology import ParallelDims, Roles, describe_nodes, elastic_grad_accum_steps
from plait.types import ALL_DEVICES, ALWAYS, PlanError

COMM_HOOK = "engine:comm_hook"  # an engine that adapts the deprecated plait_comm_hook

# The decisions every run needs, and the config setting that picks who makes each.
REQUIRED_DECISIONS = {
    "plait_build_model": "model._target_",
    "plait_build_dataset": "data.name",
    "plait_shard_data": "data.sharding",
    "plait_build_optimizer": "optimizer.name",
    "plait_build_lr_schedule": "optimizer.name",
    "plait_build_engine": "strategy.name",
    "plait_grad_reducer": "comm.name",
    "plait_launch": "launcher.name",
}


# The core's numeric settings, by section ("" is the top level), and the values each takes.
# parallel.dp (-1 or >= 1) is checked by ParallelDims.from_config.
CORE_RANGES = {
    "train": {
        "steps": AT_LEAST_1,
        "batch_size": AT_LEAST_1,
        "grad_accum_steps": AT_LEAST_1,
        "seq_len": AT_LEAST_1,
        "grad_clip": Range(0, meaning="0 turns clipping off"),
        "log_every": AT_LEAST_1,
        "eval_every": Range(0, meaning="0: no evaluation"),
        "eval_batches": AT_LEAST_1,
        "peak_flops": POSITIVE,
        "stop_at": AT_LEAST_1,
    },
    "parallel": {"tp": AT_LEAST_1, "pp": AT_LEAST_1, "cp": AT_LEAST_1, "ep": AT_LEAST_1},
    "launcher": {"nproc_per_node": AT_LEAST_1, "timeout_s": AT_LEAST_1},
    "": {"seed": Range(0, 2**32 - 1)},  # numpy's seeds
}  # launcher.nnodes (N or MIN:MAX) is checked by plait.config.node_range


def job_id() -> str | None:
    """The external launcher's job id (torchrun, SLURM), which every rank of a job shares."""
    for var in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        value = os.environ.get(var)
        if value and value != "none":
            return value
    return None


def default_run_name() -> str:
    """A run name every rank agrees on: the external launcher's job id, else the time and a
    random suffix (runs started in the same second, e.g. parallel trials, do not collide).

    The resolver caches its value per config: a sweep's jobs, composed from the sweep's config,
    share the name the sweep directory was given.
    """
    value = job_id()
    return f"job-{value}" if value else f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"


OmegaConf.register_new_resolver("plait_run_name", default_run_name, replace=True, use_cache=True)


@dataclass
class Plan:
    cfg: DictConfig
    pm: PlaitPluginManager
    dims: ParallelDims | None
    problems: list[str] = field(default_factory=list)
    roles: Roles | None = None
    backend_configs: dict[str, Any] = field(default_factory=dict)

    def check(self) -> Plan:
        if self.problems:
            raise PlanError(self.problems)
        return self


CONFIG_NAME = "config"


@contextmanager
def hydra_app(pm: PlaitPluginManager, config_dir: str | None = None) -> Iterator[Hydra]:
    """Hydra set up as ``@hydra.main`` would set it up for plait: the plugins' schemas in the
    ConfigStore, ``plait.conf`` (and ``--config-dir``) on the search path. Both a single run
    (composed here) and ``plait train -m`` (``Hydra.multirun``) start from this."""
    cs = SchemaStore(ConfigStore.instance())
    store_core_schemas(cs)
    pm.hook.plait_register_configs(config_store=cs)
    version.setbase("1.3")
    search_path = create_config_search_path("pkg://plait.conf")
    if config_dir is not None:
        directory = Path(config_dir).absolute()
        if not directory.is_dir():
            raise ValueError(f"--config-dir {config_dir}: no such directory")
        search_path.prepend(
            "command-line", f"file://{directory}", anchor=SearchPathQuery(provider="schema")
        )
    try:
        yield Hydra.create_main_hydra2(task_name="plait", config_search_path=search_path)
    finally:
        GlobalHydra.instance().clear()


def unknown_option(error: MissingConfigException) -> PlanError | None:
    """Hydra's "Could not find 'strategy/zero9'" as a refusal that lists the options a user can
    choose: the group's YAML options, without the ``base_*`` schemas plugins store for them
    (those are extended by options, never chosen) or Hydra's search path. None when the missing
    config is not an option of a group."""
    group, _, option = (error.missing_cfg_file or "").rpartition("/")
    if not group or not error.options:
        return None
    choices = sorted(o for o in error.options if not o.startswith("base_"))
    setting = group.replace("/", ".")
    return PlanError([f"{setting}={option}: no such option; choose one of {', '.join(choices)}"])


def compose_config(overrides: Iterable[str], pm: PlaitPluginManager) -> DictConfig:
    """Compose ``plait.conf/config.yaml`` with the user's overrides, as Hydra's compose API does
    (no output directory, no logging set-up, no ``hydra`` node); renamed settings are read by
    their new names (:mod:`plait.renames`). Each choice of config options is merged once per
    process (:mod:`plait.composed`)."""
    overrides = rename_overrides(overrides, renamed_settings(pm))
    with hydra_app(pm) as hydra:
        try:
            cfg = COMPOSED.compose(hydra, CONFIG_NAME, overrides)
        except MissingConfigException as e:
            raise unknown_option(e) or e from None
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg


def make_plan(
    overrides: Iterable[str] = (),
    objects: Iterable[Any] = (),
    available: PlaitPluginManager | None = None,
) -> Plan:
    """Compose, select plugins, let them configure, and collect every problem. ``available``: a
    manager of every available plugin (``objects`` among them) already built, not built again."""
    objects = list(objects)
    available = available or make_plugin_manager(objects=objects)
    return plan_config(compose_config(overrides, available), objects, available)


def plan_config(
    cfg: DictConfig, objects: Iterable[Any] = (), available: PlaitPluginManager | None = None
) -> Plan:
    """The plan for an already composed config (one job of a sweep, composed by Hydra)."""
    objects = list(objects)
    available = available or make_plugin_manager(objects=objects)
    pm = keep_selected(make_plugin_manager(cfg, objects), cfg)
    with open_dict(cfg):
        pm.hook.plait_configure(cfg=cfg)
    run_name_given = not OmegaConf.is_interpolation(cfg.run, "name")
    OmegaConf.resolve(cfg)
    OmegaConf.set_readonly(cfg, True)

    plan = Plan(cfg=cfg, pm=pm, dims=None)
    # Out-of-range numbers first: the layout and the plugins' checks compute with them.
    plan.problems += broken_problems(pm) + comm_hook_problems(pm, available, cfg)
    plan.problems += core_range_problems(cfg)
    try:  # launcher.nnodes is parsed here once; the plan's dims carry it (dims.nodes)
        nodes = node_range(cfg.launcher.nnodes)
    except ValueError as e:
        nodes = None
        plan.problems.append(str(e))
    if not plan.problems and nodes is not None:
        try:
            world_size = planned_world_size(cfg, nodes)
            plan.roles = Roles.resolve(
                pm.hook.plait_assign_roles(cfg=cfg, world_size=world_size), world_size
            )
            plan.dims = ParallelDims.from_config(
                cfg, world_size=len(plan.roles.trainers), nodes=nodes
            )
        except ValueError as e:
            plan.problems.append(str(e))
    plan.problems += core_problems(cfg, nodes, plan.dims, run_name_given)
    if plan.dims is not None and plan.roles is not None:
        plan.problems += elastic_problems(cfg, plan.dims, plan.roles)
    plan.problems += unselected_choices(pm, available, cfg)
    plan.problems += check_conflicts(pm)
    if plan.dims is not None:
        plan.problems += capability_problems(pm, cfg, plan.dims)
        plan.problems += unmet_requirements(pm, available, cfg, plan.dims)
        for found in pm.hook.plait_validate(cfg=cfg, dims=plan.dims, hook=pm.hook):
            plan.problems += found or []
        for generated in pm.hook.plait_backend_config(cfg=cfg, dims=plan.dims, hook=pm.hook):
            plan.backend_configs.update(generated or {})
    return plan


def comm_hook_problems(
    pm: PlaitPluginManager, available: PlaitPluginManager, cfg: DictConfig
) -> list[str]:
    """A deprecated ``plait_comm_hook`` (hook spec 1.0) needs an engine that adapts it."""
    users = [i.plugin_name for i in pm.hook.plait_comm_hook.get_hookimpls()]
    takers = [r.name for r in pm.records.values() if COMM_HOOK in r.info.provides]
    if not users or takers:
        return []
    offered = offered_by(COMM_HOOK, available)
    return [
        f"plugin {users[0]!r} implements plait_comm_hook (a torch DDP comm hook), which only "
        f"{offered} takes, not strategy={cfg.strategy.name}: use {offered}, or port it to "
        "plait_grad_reducer, which every strategy with a reducer takes"
    ]


def core_range_problems(cfg: DictConfig) -> list[str]:
    return [
        problem
        for section, ranges in CORE_RANGES.items()
        for problem in range_problems(section, cfg[section] if section else cfg, ranges)
    ]


def planned_world_size(cfg: DictConfig, nodes: NodeRange) -> int:
    """The world size the plan is checked at: the external launcher's (``torchrun``) where it
    started this process, else ``launcher.nnodes x launcher.nproc_per_node``. An elastic job
    (``launcher.nnodes=MIN:MAX``) is planned at MAX nodes, the size its settings are given for."""
    if nodes.elastic:
        return nodes.max * int(os.environ.get("LOCAL_WORLD_SIZE", cfg.launcher.nproc_per_node))
    return int(os.environ.get("WORLD_SIZE", nodes.max * cfg.launcher.nproc_per_node))


def device_problems(cfg: DictConfig) -> list[str]:
    """A device this node does not have. (Each process takes the GPU of its local rank; the
    launcher, which knows how many processes a node runs, refuses too few GPUs.)"""
    if cfg.device not in ("auto", *sorted(ALL_DEVICES)):
        return [
            f"device={cfg.device}: choose auto, {' or '.join(sorted(ALL_DEVICES))} (each "
            "process takes the GPU of its local rank)"
        ]
    if cfg.device == "cuda" and torch.cuda.device_count() == 0:
        return [
            f"device=cuda: torch sees no CUDA device on this node (torch {torch.__version__}, "
            f"CUDA build {torch.version.cuda}): use device=cpu"
        ]
    return []


def core_problems(
    cfg: DictConfig, nodes: NodeRange | None, dims: ParallelDims | None, run_name_given: bool
) -> list[str]:
    """``nodes``: ``launcher.nnodes`` parsed (None: it is not a node count, reported already)."""
    problems = device_problems(cfg) + allocator_problems(
        OmegaConf.select(cfg, "launcher.allocator", default="auto"),
        OmegaConf.select(cfg, "launcher.decommit_above", default=DECOMMIT_ABOVE),
    )
    if nodes is not None and nodes.max > 1 and not run_name_given and not job_id():
        problems.append(
            f"launcher.nnodes={cfg.launcher.nnodes} needs run.name=<name>, the same on every "
            "node: without it each node names the run after its own clock, so the nodes would "
            "write different run directories"
        )
    if cfg.precision not in PRECISIONS:
        problems.append(f"precision={cfg.precision}: choose one of {', '.join(PRECISIONS)}")
    train = cfg.train
    if train.activation_checkpointing not in ACTIVATION_CHECKPOINTING:
        problems.append(
            f"train.activation_checkpointing={train.activation_checkpointing}: "
            f"choose one of {', '.join(ACTIVATION_CHECKPOINTING)}"
        )
    if dims is not None and train.batch_size % (train.grad_accum_steps * dims.dp):
        per_step = train.grad_accum_steps * dims.dp
        problems.append(
            f"train.batch_size={train.batch_size} is not divisible by train.grad_accum_steps"
            f"({train.grad_accum_steps}) * dp({dims.dp}) = {per_step}: set train.batch_size to "
            f"a multiple of {per_step}"
        )
    return problems


def elastic_problems(cfg: DictConfig, dims: ParallelDims, roles: Roles) -> list[str]:
    """An elastic job (``launcher.nnodes=MIN:MAX``) must keep its global batch at every node
    count it may run at: data parallelism takes what tp and pp leave, and each size's dp shares
    the step's micro-batches evenly (``plait.topology.elastic_grad_accum_steps``)."""
    nodes = dims.nodes
    if not nodes.elastic:
        return []
    setting = f"launcher.nnodes={cfg.launcher.nnodes}"
    if cfg.parallel.dp != -1:
        return [
            f"{setting} changes the world size, but parallel.dp={cfg.parallel.dp} is fixed: "
            "set parallel.dp=-1 (data parallelism takes what tp and pp leave at each size)"
        ]
    if not roles.single:
        return [
            f"{setting}: strategy={cfg.strategy.name} gives ranks other roles than trainer, "
            "whose number would change with the nodes: use a fixed launcher.nnodes"
        ]
    per_node = dims.world_size // nodes.max
    problems = []
    for count in range(nodes.min, nodes.max):
        try:
            at_count = ParallelDims.from_config(cfg, world_size=count * per_node, nodes=nodes)
        except ValueError as e:
            problems.append(f"{setting}: at {count} node(s) x {per_node} process(es), {e}")
            continue
        try:
            elastic_grad_accum_steps(cfg, at_count, per_node)
        except ValueError as e:
            problems.append(str(e))
    return problems


def unselected_choices(
    pm: PlaitPluginManager, available: PlaitPluginManager, cfg: DictConfig
) -> list[str]:
    """A required decision nobody makes: name the setting and the values that would work."""
    problems = []
    made = deciders(pm, bridged=True)  # a deprecated hook decides the hook replacing it
    for hook, setting in REQUIRED_DECISIONS.items():
        if made.get(hook):
            continue
        options = sorted(
            {
                str(option)
                for r in available.records.values()
                for k, v in r.info.selected_by.items()
                if k == setting
                for option in (v if isinstance(v, (list, tuple, set, frozenset)) else (v,))
            }
        )
        value = OmegaConf.select(cfg, setting, default=None)
        hint = f"; installed plugins offer: {', '.join(options)}" if options else ""
        problems.append(f"{setting}={value} selects no plugin that decides {hook}{hint}")
    return problems


def capability_problems(pm: PlaitPluginManager, cfg: DictConfig, dims: ParallelDims) -> list[str]:
    """Refuse a device, precision or parallel axis that an active plugin does not declare. A
    device or precision the core does not know is refused once by the core rules, not again
    by every plugin."""
    problems = []
    device = cfg.device if cfg.device in ALL_DEVICES else None
    active = {r.info.name for r in pm.records.values()}
    axis_setting = {axis: f"parallel.{axis}" for axis in ("dp", "cp", "tp", "pp", "ep")}
    for record in pm.records.values():
        info, who = record.info, f"plugin {record.info.name!r}"
        if device is not None and device not in info.devices:
            problems.append(
                f"{who} does not run on device={device}: supports {', '.join(sorted(info.devices))}"
            )
        if cfg.precision in PRECISIONS and cfg.precision not in info.precisions:
            problems.append(
                f"{who} does not support precision={cfg.precision}: choose one of "
                f"{', '.join(sorted(info.precisions))}"
            )
        for axis in sorted(dims.enabled_axes - info.parallel_axes):
            problems.append(
                f"{who} does not support {axis} parallelism "
                f"({axis_setting[axis]}={getattr(dims, axis)}): set "
                f"{axis_setting[axis]}=1 or choose another plugin for it"
            )
        for other in sorted(info.excludes & active):
            problems.append(
                f"{who} cannot run together with plugin {other!r}: "
                "change the setting that selects one of them"
            )
    return problems


def unmet_requirements(
    pm: PlaitPluginManager, available: PlaitPluginManager, cfg: DictConfig, dims: ParallelDims
) -> list[str]:
    """A capability an active plugin requires that no active plugin provides: name the setting
    that needs it and the installed plugins that would provide it."""
    provided = {c for r in pm.records.values() for c in r.info.provides}
    problems = []
    for record in pm.records.values():
        for when, needs in record.info.requires.items():
            if when != ALWAYS and getattr(dims, when) == 1:
                continue
            for capability in sorted(set(needs) - provided):
                cause = "" if when == ALWAYS else f" for parallel.{when}={getattr(dims, when)}"
                offers = [
                    _selection(r)
                    for r in available.records.values()
                    if capability in r.info.provides
                ]
                fix = (
                    f"installed plugins that provide it: {', '.join(offers)}"
                    if offers
                    else "no installed plugin provides it"
                )
                if when != ALWAYS:
                    fix += f"; or set parallel.{when}=1"
                problems.append(
                    f"plugin {record.info.name!r} needs {capability!r}{cause}, which "
                    f"no active plugin provides ({fix})"
                )
    return problems


def _selection(record) -> str:
    """``ddp (strategy.name=ddp)``: a plugin and the setting that turns it on."""
    chosen = ", ".join(
        f"{k}={v if isinstance(v, str) else '|'.join(map(str, v))}"
        for k, v in record.info.selected_by.items()
    )
    return f"{record.info.name} ({chosen})" if chosen else record.info.name


def format_plan(plan: Plan) -> str:
    """The text ``plait plan`` prints."""
    cfg, lines = plan.cfg, []
    if plan.dims is not None:
        d = plan.dims
        per_node = cfg.launcher.nproc_per_node
        trainers = "" if plan.roles is None or plan.roles.single else " trainers"
        experts = f" (dp = edp {d.edp} x ep {d.ep})" if d.ep > 1 else ""
        cp = f" x cp {d.cp}" if d.cp > 1 else ""
        lines.append(
            f"mesh: world_size={d.world_size}{trainers} = pp {d.pp} x dp {d.dp}{cp} x "
            f"tp {d.tp}{experts} on {d.nnodes} node(s) x {per_node} process(es)"
        )
        # Before launch, nodes as plait's launcher and torchrun number ranks: node by node.
        lines += describe_nodes(d, [r // per_node for r in range(d.nnodes * per_node)], plan.roles)
    spec = plan.pm.hook.plait_comm_spec(cfg=cfg)
    if spec is not None:
        bucket = (
            "the strategy's default"
            if spec.bucket_bytes is None
            else f"{spec.bucket_bytes / 2**20:g} MiB"
        )
        lines.append(f"comm: {spec.algorithm}, compression {spec.compression}, bucket {bucket}")
    lines.append(f"device={cfg.device} precision={cfg.precision} run.dir={cfg.run.dir}")
    lines.append("decisions:")
    for hook, names in sorted(deciders(plan.pm, bridged=True).items()):
        if not names and getattr(plan.pm.hook, hook).spec.warn_on_impl:
            continue  # a deprecated hook no plugin implements
        lines.append(f"  {hook:28s} {', '.join(names) if names else '(core default)'}")
    lines.append("active plugins:")
    for record in plan.pm.records.values():
        lines.append(f"  {record.info.name:16s} {record.source}")
    provided = sorted({c for r in plan.pm.records.values() for c in r.info.provides})
    lines.append(f"capabilities provided: {', '.join(provided) or '(none)'}")
    for backend, generated in plan.backend_configs.items():
        lines.append(f"{backend} config:")
        lines += ["  " + line for line in OmegaConf.to_yaml(generated).splitlines()]
    if plan.problems:
        lines.append("refused:")
        lines += [f"  - {p}" for p in plan.problems]
    else:
        lines.append("ok: nothing refused")
    return "\n".join(lines)
