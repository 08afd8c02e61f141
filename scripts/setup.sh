#!/usr/bin/env bash
# Set up plait in ./.venv on a fresh machine, with what training needs and nothing else: CPU torch
# first where there is no GPU (an unpinned torch would pull a multi-GB CUDA build), then plait with
# the extras named by PLAIT_EXTRAS (default: hf; scripts/test.sh adds test), and DeepSpeed's CPU
# ops. No system package: what only the tests need is scripts/test.sh's set-up.
#
#     ./scripts/setup.sh                       # what ./scripts/train.sh runs
#     PLAIT_EXTRAS=test,hf,ray,kubernetes,eval,torchft ./scripts/setup.sh  # what ./scripts/test.sh runs
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip uv
# uv installs what pip would, from where pip would (this machine's pip settings, as
# scripts/pip_to_uv.py hands them over), and compiles each module as pip does (uv does not by
# default, and where PYTHONDONTWRITEBYTECODE is set every process would compile torch's again):
# torch and the test extras in 92-107 s here against 198-245 s with pip. Where uv fails, pip
# installs.
install() {
  local options=() cert=() line parts
  while read -r line; do
    case $line in
      SSL_CERT_FILE=*) cert=("$line") ;;
      *) read -ra parts <<<"$line" && options+=("${parts[@]}") ;;
    esac
  done < <(python scripts/pip_to_uv.py)
  env "${cert[@]}" uv pip install -q --compile-bytecode "${options[@]}" "$@" || python -m pip install -q "$@"
}
if ! command -v nvidia-smi >/dev/null 2>&1; then
  install torch==2.13.0
fi
install -e ".[${PLAIT_EXTRAS:-hf}]"
# pip compiles what it installs, but not an editable project's own files. Where
# PYTHONDONTWRITEBYTECODE is set (as on this project's machines), no process writes them either,
# and every fresh one (a command, the worker server, a spawned worker) compiled plait's modules
# again: 0.7 s of CPU each, measured. compileall writes them once here, whatever that variable says.
python -m compileall -q core plugins scripts tests
if ! command -v nvidia-smi >/dev/null 2>&1; then
  # DeepSpeed compiles its CPU ops (CPU Adam, shared-memory all-reduce) on first use, into
  # $TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions; scripts/test.sh: .venv's). Build
  # them here, in one process: workers that start compiling together and are killed mid-build
  # leave a lock every later run waits on forever.
  find "${TORCH_EXTENSIONS_DIR:-$HOME/.cache/torch_extensions}" -name lock -delete 2>/dev/null || true
  DS_ACCELERATOR=cpu python - <<'PY'
from deepspeed.accelerator import get_accelerator

for name in ("CPUAdamBuilder", "ShareMemCommBuilder"):
    get_accelerator().create_op_builder(name).load(verbose=False)
PY
fi
