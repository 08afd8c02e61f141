"""Print ``uv pip install``'s options for where this machine's pip installs from.

scripts/setup.sh installs with uv, which does not read pip's settings: a machine's local wheels
(such as a CPU build of torch), mirrors, constraints and CA bundle live there, in pip.conf and
``PIP_*`` variables. ``pip config list`` gives them; this prints each as uv's option, one
``--option value`` per line, and the CA bundle as ``SSL_CERT_FILE=path`` (uv's variable).
pip weighs every index alike, so uv is told to as well (``--index-strategy unsafe-best-match``).

    python scripts/pip_to_uv.py          # run with the virtual environment's python
"""

from __future__ import annotations

import subprocess
import sys

OPTIONS = {
    "find-links": "--find-links",
    "index-url": "--index-url",
    "extra-index-url": "--extra-index-url",
    "constraint": "--constraint",
}


def uv_options(pip_config: str) -> list[str]:
    """``pip config list``'s lines (``global.find-links='/opt/wheels'``) as uv's options."""
    lines = ["--index-strategy unsafe-best-match"]
    for line in pip_config.splitlines():
        key, _, quoted = line.partition("=")
        name, value = key.rpartition(".")[2], quoted.strip("'\"")
        for item in value.split():
            if name in OPTIONS:
                lines.append(f"{OPTIONS[name]} {item}")
            elif name == "cert":
                lines.append(f"SSL_CERT_FILE={item}")
    return list(dict.fromkeys(lines))


if __name__ == "__main__":
    listed = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True
    ).stdout
    print("\n".join(uv_options(listed)))
