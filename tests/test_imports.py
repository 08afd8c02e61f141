"""The layers of the house, as import-linter contracts (``[tool.importlinter]`` in
pyproject.toml): plugins over the engine library over the thin core, and plugins independent of
each other but for the edges docs/architecture.md names. A new forbidden import is a red test."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).parents[1]
_spec = importlib.util.spec_from_file_location(
    "check_imports", ROOT / "scripts" / "check_imports.py"
)
check_imports = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_imports)


def lint(tmp_path: Path, replaced: dict[str, str] | None = None):
    return check_imports.lint_imports(check_imports.package_view(tmp_path, replaced))


def test_the_import_contracts_hold(tmp_path):
    done = lint(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Contracts: 2 kept, 0 broken." in done.stdout


def with_import(path: str, module: str) -> dict[str, str]:
    """``path`` (in the repository) with ``import <module>`` added at its end."""
    return {path: (ROOT / path).read_text() + f"\nimport {module}  # noqa\n"}


@pytest.mark.parametrize(
    "path, module, broken, chain",
    [
        (
            "plugins/zero/engine.py",
            "plait.plugins.ddp",
            "plugins are independent of each other BROKEN",
            "plait.plugins.zero.engine -> plait.plugins.ddp",
        ),
        (
            "plugins/fsdp/engine.py",
            "plait.plugins.pipeline.split",
            "plugins are independent of each other BROKEN",
            "plait.plugins.fsdp.engine -> plait.plugins.pipeline.split",
        ),
        (
            "core/engine/step.py",
            "plait.plugins.optim",
            "plugins over the engine library over the thin core BROKEN",
            "plait.engine.step -> plait.plugins.optim",
        ),
        (
            "core/train.py",
            "plait.engine.step",
            "plugins over the engine library over the thin core BROKEN",
            "plait.train -> plait.engine.step",
        ),
    ],
)
def test_a_forbidden_import_breaks_a_contract(tmp_path, path, module, broken, chain):
    done = lint(tmp_path, with_import(path, module))
    assert done.returncode == 1, done.stdout + done.stderr
    assert broken in done.stdout
    assert chain in done.stdout


def test_the_plugin_edges_kept_are_the_ones_the_architecture_names():
    """At most three plugin-to-plugin edges, each in docs/architecture.md with its reason."""
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    [independence] = [c for c in contracts["contracts"] if c["type"] == "independence"]
    edges = {
        tuple(m.split(".")[2] for m in line.split(" -> "))
        for line in independence["ignore_imports"]
    }
    assert len(edges) <= 3
    documented = set(
        re.findall(
            r"^\| `(\w+)` → `(\w+)` \| .+ \|$",
            (ROOT / "docs" / "architecture.md").read_text(),
            re.M,
        )
    )
    assert documented == edges
