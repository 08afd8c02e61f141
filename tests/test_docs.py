"""The documentation stays true to the code."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]


def test_hook_reference_is_generated_from_the_current_hook_spec():
    check = subprocess.run([sys.executable, "scripts/hook_docs.py", "--check"], cwd=ROOT)
    assert check.returncode == 0, "docs/plugins.md is stale: run python scripts/hook_docs.py"


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    assert "./scripts/test.sh" in readme and "./scripts/train.sh" in readme
    assert "./scripts/test.sh" in (ROOT / ".ci" / "run").read_text()
