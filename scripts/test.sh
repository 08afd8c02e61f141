#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
. .venv/bin/activate
export DS_ACCELERATOR=cpu
exec python -m pytest -q --durations=25 "$@"
