"""scripts/setup.sh installs with uv from where pip would install (scripts/pip_to_uv.py): a wheel
that lies only in a folder pip.conf names is found by uv with the options it is handed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
UV = shutil.which("uv", path=str(Path(sys.executable).parent))


def probe_wheel(folder: Path) -> None:
    """A one-module wheel, ``plait_probe`` 1.0, that no index has."""
    info = "plait_probe-1.0.dist-info"
    with zipfile.ZipFile(folder / "plait_probe-1.0-py3-none-any.whl", "w") as wheel:
        wheel.writestr("plait_probe/__init__.py", "")
        wheel.writestr(
            f"{info}/METADATA", "Metadata-Version: 2.1\nName: plait-probe\nVersion: 1.0\n"
        )
        wheel.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        wheel.writestr(f"{info}/RECORD", "")


def pip_to_uv(tmp_path: Path, config: str) -> list[str]:
    (tmp_path / "pip.conf").write_text(config)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = str(tmp_path / "pip.conf")
    done = subprocess.run(
        [sys.executable, ROOT / "scripts" / "pip_to_uv.py"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    return done.stdout.splitlines()


@pytest.mark.skipif(UV is None, reason="uv is installed by scripts/setup.sh")
def test_uv_finds_a_wheel_from_the_folder_pip_conf_names(tmp_path):
    wheels, index = tmp_path / "wheels", tmp_path / "index"
    wheels.mkdir(), index.mkdir()
    probe_wheel(wheels)
    lines = pip_to_uv(
        tmp_path,
        f"[global]\nfind-links = {wheels}\nindex-url = file://{index}\n"
        "cert = /etc/ssl/certs/ca-certificates.crt\n",
    )
    assert lines[0] == "--index-strategy unsafe-best-match"
    assert {  # with what the machine's own pip settings add
        f"--find-links {wheels}",
        f"--index-url file://{index}",
        "SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt",
    } <= set(lines)
    options = [word for line in lines if not line.startswith("SSL_") for word in line.split()]
    command = [UV, "pip", "install", "--dry-run", "--python", sys.executable, "plait_probe"]
    found = subprocess.run([*command, *options], capture_output=True, text=True)
    assert found.returncode == 0, found.stderr
    assert "plait-probe==1.0" in found.stderr
    unfound = subprocess.run([*command, "--index-url", f"file://{index}"], capture_output=True)
    assert unfound.returncode != 0  # only pip's folder has it


@pytest.mark.parametrize("package", ["torch", "deepspeed", "transformers", "hydra"])
def test_the_installed_packages_are_compiled(package):
    """Set-up compiles what it installs (pip does; uv only when told): where
    PYTHONDONTWRITEBYTECODE is set, as on this project's machines, no process writes a module's
    compiled file, and every fresh interpreter would compile torch's again."""
    import importlib.util

    spec = importlib.util.find_spec(package)
    if spec is None:
        pytest.skip(f"{package} is not installed")
    assert Path(importlib.util.cache_from_source(spec.origin)).is_file()
