#!/usr/bin/env bash
# Set up plait in ./.venv on a fresh machine: CPU torch first where there is no GPU (an
# unpinned torch would pull a multi-GB CUDA build), then plait with its test extra.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
# SLURM and munge, for tests/test_slurm.py (a controller and a node daemon on localhost), where
# root and apt-get are available; elsewhere that test skips, saying why.
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && [ ! -x /usr/sbin/slurmd ]; then
  { DEBIAN_FRONTEND=noninteractive apt-get update -qq &&
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null; } ||
    echo "setup: slurm-wlm and munge not installed; tests/test_slurm.py will skip" >&2
fi
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
if ! command -v nvidia-smi >/dev/null 2>&1; then
  python -m pip install -q torch==2.13.0
fi
python -m pip install -q -e ".[test,hf,eval]"
if ! command -v nvidia-smi >/dev/null 2>&1; then
  # DeepSpeed compiles its CPU ops (CPU Adam, shared-memory all-reduce) on first use, into
  # ~/.cache/torch_extensions. Build them here, in one process: workers that start compiling
  # together and are killed mid-build leave a lock every later run waits on forever.
  find "${TORCH_EXTENSIONS_DIR:-$HOME/.cache/torch_extensions}" -name lock -delete 2>/dev/null || true
  DS_ACCELERATOR=cpu python - <<'PY'
from deepspeed.accelerator import get_accelerator

for name in ("CPUAdamBuilder", "ShareMemCommBuilder"):
    get_accelerator().create_op_builder(name).load(verbose=False)
PY
fi
# A headless browser for the test that opens `plait report`'s HTML (tests/test_report.py skips,
# saying why, without it): Debian's chromium, where this runs as root with apt.
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -q && apt-get install -y -q chromium) >/dev/null || echo "setup: chromium not installed (apt failed)" >&2
fi
