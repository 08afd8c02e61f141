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


def entry_points_by_package() -> dict[str, set[str]]:
    """``pyproject.toml``'s ``plait`` entry points, by the package of ``plugins/`` they live in."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    found: dict[str, set[str]] = {}
    for name, target in project["entry-points"]["plait"].items():
        package = target.removeprefix("plait.plugins.").split(":")[0].split(".")[0]
        found.setdefault(package, set()).add(name)
    return found


def documented_packages() -> dict[str, set[str]]:
    """docs/architecture.md's package table: each ``plugins/`` package and the entry points its
    second column names (backticked, outside parentheses)."""
    import re

    text = (ROOT / "docs" / "architecture.md").read_text()
    rows = re.findall(r"^\| `(\w+)/` \| (.+?) \| .+ \|$", text, re.M)
    documented = {}
    for package, plugins in rows:
        while re.search(r"\([^()]*\)", plugins):
            plugins = re.sub(r"\([^()]*\)", "", plugins)
        documented[package] = set(re.findall(r"`(\w+)`", plugins))
    return documented


def test_the_architecture_package_table_lists_every_plugin_package_and_entry_point():
    packages = {p.name for p in (ROOT / "plugins").iterdir() if p.is_dir() and any(p.glob("*.py"))}
    documented = documented_packages()
    assert set(documented) == packages, (
        f"docs/architecture.md lacks {sorted(packages - set(documented))}, lists "
        f"{sorted(set(documented) - packages)} that plugins/ does not have"
    )
    assert documented == entry_points_by_package()


def test_the_main_job_installs_no_system_package_and_the_tests_install_theirs():
    """``./scripts/train.sh`` sets up only what training needs; the system packages only tests
    use (SLURM, munge, chromium) are ``./scripts/test.sh``'s set-up."""
    training = [(ROOT / "scripts" / name).read_text() for name in ("train.sh", "setup.sh")]
    assert all("apt-get" not in script and "dnf " not in script for script in training)
    assert "./scripts/setup.sh" in training[0]
    testing = (ROOT / "scripts" / "test.sh").read_text()
    assert all(package in testing for package in ("slurm-wlm", "munge", "chromium", "apt-get"))


def documented_capabilities() -> dict[str, set[str]]:
    """docs/architecture.md's capability table: each capability and the plugins its "provided
    by" column names (backticked, outside parentheses)."""
    import re

    text = (ROOT / "docs" / "architecture.md").read_text()
    rows = re.findall(r"^\| `((?:engine|model|fault):\w+)` \| .+? \| (.+?) \| .*\|$", text, re.M)
    documented = {}
    for capability, providers in rows:
        while re.search(r"\([^()]*\)", providers):
            providers = re.sub(r"\([^()]*\)", "", providers)
        documented[capability] = set(re.findall(r"`(\w+)`", providers))
    return documented


def test_the_capability_table_names_every_capability_and_its_providers():
    from plait.plugin_manager import make_plugin_manager

    provided: dict[str, set[str]] = {}
    for record in make_plugin_manager().records.values():
        for capability in record.info.provides:
            provided.setdefault(capability, set()).add(record.info.name)
    assert documented_capabilities() == provided


def test_the_architecture_names_the_mesh_in_its_order():
    from plait.topology import MESH_AXES

    text = (ROOT / "docs" / "architecture.md").read_text()
    assert f"`({', '.join(MESH_AXES)})`" in text and f"`{' × '.join(MESH_AXES)}`" in text
    for axis in MESH_AXES:  # no description of the mesh that leaves an axis out
        others = [a for a in MESH_AXES if a != axis]
        assert f"`{' × '.join(others)}`" not in text and f"`({', '.join(others)})`" not in text
