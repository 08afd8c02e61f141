"""The README's in-house plugin example, run exactly as written."""

import re
import sys
from pathlib import Path

import pytest

from plait.testing import read_metrics, run_training

README = Path(__file__).parents[1] / "README.md"


@pytest.mark.slow
def test_readme_plugin_example_loads_by_dotted_path_and_its_hooks_fire(tmp_path, monkeypatch):
    code = re.search(r"```python\n# my_team/loss_log.py\n(.*?)```", README.read_text(), re.S)[1]
    assert len(code.splitlines()) <= 25
    package = tmp_path / "src" / "my_team"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "loss_log.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "src"))
    run_dir = run_training(
        tmp_path / "r", ["+plugins=[my_team.loss_log:plugin]", "launcher.nproc_per_node=2"]
    )
    rows = [line.split("\t") for line in (run_dir / "loss_log.tsv").read_text().splitlines()]
    losses = [m["loss"] for m in read_metrics(run_dir)]
    assert [int(r[0]) for r in rows] == [1, 2, 3, 4]
    assert [float(r[1]) for r in rows] == pytest.approx(losses, abs=1e-6)
    sys.modules.pop("my_team.loss_log", None)
