"""``plait <command> [hydra overrides]``: train, plan, plugins, and commands that plugins add.

Examples::

    plait train strategy=ddp launcher.nproc_per_node=2 train.steps=100
    plait train -m strategy=ddp,zero2 optimizer.lr=1e-3,3e-3     # a Hydra multirun: 4 runs
    plait train --cfg job strategy=zero2                          # print the composed config
    plait plan parallel.tp=2 launcher.nproc_per_node=4
    plait plan --search world_size=8 model=gpt2_small --memory-gb 80   # the layout planner
    plait plugins --check                                          # exit 2 if a plugin is broken
"""

from __future__ import annotations

import sys
from functools import partial
from typing import Callable

from hydra._internal.utils import get_args_parser
from hydra.errors import HydraException, MissingConfigException
from hydra.types import RunMode
from omegaconf import open_dict
from omegaconf.errors import OmegaConfBaseException

from plait import api
from plait.export import cmd_export
from plait.forkserver import freeze_at_exit
from plait.plan import (
    CONFIG_NAME,
    compose_config,
    format_plan,
    hydra_app,
    make_plan,
    unknown_option,
)
from plait.plugin_manager import PlaitPluginManager, broken_problems, make_plugin_manager
from plait.renames import rename_overrides, renamed_settings
from plait.sample import cmd_sample
from plait.types import PlanError

USAGE = """usage: plait <command> [key=value ...]

commands:
{commands}

Everything after the command is a Hydra override, e.g. strategy=zero3 parallel.tp=2."""


def cmd_train(argv: list[str], available: PlaitPluginManager) -> int:
    """``plait train`` takes Hydra's command line, as an ``@hydra.main`` app does: overrides,
    ``-m/--multirun``, ``--cfg job|hydra|all`` (with ``--resolve``, ``-p``), ``--info``,
    ``--config-dir``, ``--config-name``, ``--hydra-help``, ``-h``. A config that sets
    ``hydra.mode: MULTIRUN`` (``launcher=slurm``) runs as a multirun without ``-m``. ``available``:
    the CLI's manager of every available plugin."""
    parser = get_args_parser()
    args = parser.parse_args(argv)
    for flag, given in (
        ("--config-path", args.config_path),
        ("--run", args.run),
        ("--shell-completion", args.shell_completion),
        ("--experimental-rerun", args.experimental_rerun),
    ):
        if given:
            raise ValueError(
                f"plait train does not take {flag}"
                + ("; use --config-dir" if flag == "--config-path" else "")
            )
    if args.multirun + bool(args.cfg) + bool(args.info) > 1:
        raise ValueError("plait train takes only one of -m/--multirun, --cfg and --info")
    name = args.config_name or CONFIG_NAME
    overrides = rename_overrides(args.overrides, renamed_settings(available))
    with hydra_app(available, args.config_dir) as hydra:
        if args.help:
            hydra.app_help(config_name=name, args_parser=parser, args=args)
            return 0
        if args.hydra_help:
            hydra.hydra_help(config_name=name, args_parser=parser, args=args)
            return 0
        if args.cfg:
            hydra.show_cfg(
                config_name=name,
                overrides=overrides,
                cfg_type=args.cfg,
                package=args.package,
                resolve=args.resolve,
            )
            return 0
        if args.info:
            hydra.show_info(args.info, config_name=name, overrides=overrides)
            return 0
        # Composed once (1-2 s): Hydra's own entry point composes for ``hydra.mode`` first and
        # again for the run. Only a config that fails to compose as one run (a sweep in the
        # overrides) is composed again, as a multirun, to read its mode.
        multirun = args.multirun
        if not multirun:
            try:
                cfg = hydra.compose_config(
                    name, overrides, run_mode=RunMode.RUN, with_log_configuration=False
                )
            except Exception:
                if hydra.get_mode(name, overrides) != RunMode.MULTIRUN:
                    raise
                multirun = True
            else:
                multirun = cfg.hydra.mode == RunMode.MULTIRUN
        if not multirun:
            with open_dict(cfg):
                del cfg["hydra"]
    if multirun:
        swept = api.multirun(overrides, config_dir=args.config_dir, config_name=args.config_name)
        for job in api.job_returns(swept):
            result = job.return_value
            print(
                f"plait: {' '.join(job.overrides)}: {result.run_dir}, objective {result.objective}"
            )
        return 0
    result = api.train_config(cfg, available=available)
    objective = "" if result.objective is None else f"; objective {result.objective:.6g}"
    print(f"plait: run finished; outputs in {result.run_dir}{objective}")
    return 0


def cmd_plan(overrides: list[str], available: PlaitPluginManager) -> int:
    plan = make_plan(overrides, available=available)
    print(format_plan(plan))
    return 1 if plan.problems else 0


def cmd_plugins(overrides: list[str], available: PlaitPluginManager) -> int:
    """List every registered plugin, where it came from, what selects it and its hooks, then the
    broken ones with their reason. ``--check``: exit 2 when any plugin is broken (for CI)."""
    check = "--check" in overrides
    overrides = [o for o in overrides if o != "--check"]
    cfg = compose_config(overrides, available)  # config-listed plugins count too
    pm = make_plugin_manager(cfg)
    for record in pm.records.values():
        selected = ", ".join(f"{k}={v}" for k, v in record.info.selected_by.items()) or "always"
        print(f"{record.info.name}  [{record.source}]  selected by: {selected}")
        plugin = record.plugin
        where = (
            getattr(plugin, "__name__", None)
            or f"{type(plugin).__module__}.{type(plugin).__qualname__}"
        )
        print(f"    object: {where}")
        print(f"    hooks:  {', '.join(record.hooks(pm))}")
    for broken in pm.broken.values():
        print(f"{broken.name}  [{broken.source}]  BROKEN\n    reason: {broken.reason}")
    if check:
        for problem in broken_problems(pm):
            print(f"plait: {problem}", file=sys.stderr)
        print(
            f"plait: {len(pm.records)} plugins load, {len(pm.broken)} broken",
            file=sys.stderr if pm.broken else sys.stdout,
        )
        return 2 if pm.broken else 0
    return 0


Commands = dict[str, tuple[Callable[[list[str]], int], str]]  # name -> (function, help)


def commands(available: PlaitPluginManager) -> Commands:
    """The CLI's commands, plait's and the plugins', by name. ``available``: the manager of every
    available plugin, built once per command line and handed to the commands that read it (each
    build loads and checks all of plait's 42 entry points: ~0.05-0.1 s)."""
    table: Commands = {
        "train": (partial(cmd_train, available=available), "launch training workers and train"),
        "plan": (
            partial(cmd_plan, available=available),
            "print the composed plan (plugins, mesh, backend configs, refusals)",
        ),
        "plugins": (
            partial(cmd_plugins, available=available),
            "list registered plugins, their source and hooks",
        ),
        "export": (
            cmd_export,
            "write a checkpoint's unsplit model (format=pt: a state_dict; "
            "format=hf: Hugging Face safetensors)",
        ),
        "sample": (cmd_sample, 'print a continuation of prompt="..." by a checkpoint\'s model'),
    }

    def register(name: str, function: Callable[[list[str]], int], help: str) -> None:
        if name in table:
            raise ValueError(f"two plugins add the command {name!r}")
        table[name] = (function, help)

    available.hook.plait_register_commands(register=register)
    return table


def refuse_broken_plugins(command: str, available: PlaitPluginManager) -> int | None:
    """Exit 2 before any command but ``plait plugins`` when an installed plugin is broken."""
    if command == "plugins":
        return None
    problems = broken_problems(available)
    for problem in problems:
        print(f"plait: {problem}", file=sys.stderr)
    return 2 if problems else None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    available = make_plugin_manager()
    table = commands(available)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in table:
        width = max(map(len, table))
        listing = "\n".join(f"  {name:{width}s}  {help}" for name, (_, help) in table.items())
        print(USAGE.format(commands=listing), file=sys.stderr if argv else sys.stdout)
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    # A plugin may add a flag to a command, registered as "<command> --<flag>" (e.g. the
    # planner's "plan --search"): it receives the flag and the rest of the line.
    flagged = f"{argv[0]} {argv[1].split('=', 1)[0]}" if len(argv) > 1 else argv[0]
    command, overrides = table.get(flagged, table[argv[0]])[0], argv[1:]
    refused = refuse_broken_plugins(argv[0], available)
    if refused is not None:
        return refused
    try:
        return command(overrides) or 0
    except MissingConfigException as e:  # composed by Hydra itself: -m, --cfg, --info
        print(f"plait: {unknown_option(e) or e}", file=sys.stderr)
        return 2
    except (PlanError, HydraException, OmegaConfBaseException, ValueError) as e:
        print(f"plait: {e}", file=sys.stderr)
        return 2


def run() -> None:
    """The ``plait`` command (and ``python -m plait``): :func:`main` on ``sys.argv``, exiting
    without the interpreter's final garbage collections (:func:`plait.forkserver.freeze_at_exit`).
    Tests call :func:`main` itself, in a process that lives on."""
    freeze_at_exit()
    raise SystemExit(main())
