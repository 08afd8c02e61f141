"""``plait new-plugin <name> --kind observer|comm|model|data|strategy``: write a pip-installable in-house plugin.

    plait new-plugin demo --kind observer     # ./plait-demo/: pyproject.toml (the entry point),
                                              # plait_demo/__init__.py (one documented hookimpl),
                                              # tests/test_plait_demo.py (plait.testing, 2 processes)
    pip install -e ./plait-demo && plait plugins && python -m pytest plait-demo/tests

The cookiecutter habit of datasette and pytest, without cookiecutter: the templates are
``templates.py`` in this package.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from plait import HOOKSPEC_VERSION, __version__, hookimpl
from plait.types import PluginInfo


@hookimpl
def plait_declare() -> PluginInfo:
    return PluginInfo(
        name="scaffold", description="plait new-plugin: a plugin package to start from"
    )


@hookimpl
def plait_register_commands(register) -> None:
    register(
        "new-plugin",
        cmd_new_plugin,
        "write a pip-installable plugin package (<name> --kind observer|comm|model|data|strategy [--dir D])",
    )


def cmd_new_plugin(argv: list[str]) -> int:
    from plait.plugins.scaffold.templates import KINDS

    parser = argparse.ArgumentParser(prog="plait new-plugin", description=__doc__.split("\n")[0])
    parser.add_argument("name")
    parser.add_argument("--kind", required=True, choices=sorted(KINDS))
    parser.add_argument("--dir", default=".", help="where to write plait-<name>/ (default: here)")
    args = parser.parse_args(argv)
    if not re.fullmatch(r"[a-z][a-z0-9_]*", args.name):
        raise ValueError(
            f"new-plugin: name {args.name!r} must be a Python identifier in lower "
            "case (letters, digits, _), e.g. demo or team_sync"
        )
    root = Path(args.dir) / f"plait-{args.name.replace('_', '-')}"
    if root.exists():
        raise ValueError(f"new-plugin: {root} exists; choose another name or --dir")
    for path, text in files(args.name, args.kind).items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    print(
        f"plait: wrote {root} ({args.kind} plugin {args.name!r}); next: pip install -e {root} "
        f"&& plait plugins && python -m pytest {root / 'tests'}"
    )
    return 0


def files(name: str, kind: str) -> dict[str, str]:
    """The package's files, by path relative to its root."""
    from plait.plugins.scaffold.templates import COMMON, KINDS

    values = {
        "name": name,
        "package": f"plait_{name}",
        "dist": f"plait-{name.replace('_', '-')}",
        "kind": kind,
        "upper": name.upper(),
        "plait_version": __version__,
        "hookspec": HOOKSPEC_VERSION,
    }
    templates = {**COMMON, **KINDS[kind]}
    return {
        path.format(**values): text.format(**values).lstrip("\n")
        for path, text in templates.items()
    }
