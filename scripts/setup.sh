#!/usr/bin/env bash
# Set up plait in ./.venv on a fresh machine: CPU torch first where there is no GPU (an
# unpinned torch would pull a multi-GB CUDA build), then plait with its test extra.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
if ! command -v nvidia-smi >/dev/null 2>&1; then
  python -m pip install -q torch==2.13.0
fi
python -m pip install -q -e ".[test,hf]"
