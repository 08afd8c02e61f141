"""Check the import contracts of ``[tool.importlinter]`` in pyproject.toml (the layers: plugins,
the engine library, the thin core; plugins independent of each other) with import-linter.

    python scripts/check_imports.py

prints import-linter's report (``Contracts: 2 kept, 0 broken.``) and exits with its status:
0 when every contract is kept, 1 when one is broken (naming the import chain that breaks it).

import-linter reads a package from one directory tree, while plait's package is assembled from
three (``core/`` is ``plait``, ``plugins/`` is ``plait.plugins``, ``conf/`` is ``plait.conf``; an
editable install maps them). So the check runs on a view: a temporary ``plait/`` of symbolic
links to the files of the three, first on ``PYTHONPATH``. ``tests/test_imports.py`` runs this
and also a view with one forbidden import added, which must break a contract.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).parents[1]
TREES = {"core": "plait", "plugins": "plait/plugins", "conf": "plait/conf"}


def package_view(target: Path, replaced: dict[str, str] | None = None) -> Path:
    """``target/plait``: a link to every ``.py`` file of the package's trees, or, for a path
    (relative to the repository, e.g. ``plugins/zero/__init__.py``) in ``replaced``, a file
    holding that text instead. Returns ``target``, the directory to put on ``PYTHONPATH``."""
    replaced = replaced or {}
    for tree, package in TREES.items():
        for source in (ROOT / tree).rglob("*.py"):
            relative = source.relative_to(ROOT).as_posix()
            view = target / package / source.relative_to(ROOT / tree)
            view.parent.mkdir(parents=True, exist_ok=True)
            if relative in replaced:
                view.write_text(replaced[relative])
            else:
                view.symlink_to(source)
    return target


def lint_imports(view: Path) -> subprocess.CompletedProcess:
    """import-linter over the package in ``view``, with pyproject.toml's contracts."""
    command = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")
    env = {**os.environ, "PYTHONPATH": f"{view}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run(
        [command, "--no-cache"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="plait-imports-") as directory:
        done = lint_imports(package_view(Path(directory)))
    print(done.stdout + done.stderr, end="")
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
