#!/usr/bin/env bash
# Set up what training needs (scripts/setup.sh: no system package) and run the main job:
# `plait train` on the embedded default data
# (2 worker processes, the tiny GPT, W&B offline). Extra arguments are Hydra overrides.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
. .venv/bin/activate
export DS_ACCELERATOR=${DS_ACCELERATOR:-$(command -v nvidia-smi >/dev/null 2>&1 && echo cuda || echo cpu)}
exec plait train "$@"
