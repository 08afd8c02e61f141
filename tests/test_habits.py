"""The habits that keep the house in order, run by the suite: ruff's lint and format over the whole
tree and mypy over the core and the engine library (``[tool.ruff]``, ``[tool.mypy]`` in pyproject.toml;
``.pre-commit-config.yaml`` runs the same before a commit)."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]
_spec = importlib.util.spec_from_file_location(
    "check_imports", ROOT / "scripts" / "check_imports.py"
)
check_imports = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_imports)


def tool(name: str) -> str:
    return shutil.which(name) or str(Path(sys.executable).parent / name)


def test_ruff_finds_nothing_to_lint():
    done = subprocess.run(
        [tool("ruff"), "check", "--no-cache", "."],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_ruff_format_leaves_the_tree_as_it_is():
    done = subprocess.run(
        [tool("ruff"), "format", "--check", "--no-cache", "."],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_mypy_finds_no_type_error_in_the_core_and_the_engine_library(tmp_path):
    """On the package view ``scripts/check_imports.py`` builds (``core/`` as ``plait``), the
    core's modules, ``plait.engine`` and ``plait.topology``; what they import is followed
    silently (``[tool.mypy]``)."""
    view = check_imports.package_view(tmp_path / "view")
    core = sorted(str(p.relative_to(view)) for p in (view / "plait").glob("*.py"))
    done = subprocess.run(
        [
            tool("mypy"),
            "--config-file",
            str(ROOT / "pyproject.toml"),
            "--cache-dir",
            str(tmp_path / "cache"),
            *core,
            "plait/engine",
            "plait/topology",
        ],
        cwd=view,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
