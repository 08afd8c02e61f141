#!/usr/bin/env bash
# The checks a GPU machine is for, in one command that fits a short loan (under 9 minutes on one
# H200): scripts/bench_gpu.py eager and compiled (plait against the plain loop, tokens/s, MFU),
# the CUDA/NCCL-marked tests, and scripts/bench_parity.py's ddp, ddp+defaults, fsdp and zero3
# rows on CUDA (GPT-2 small, bf16). Each check has its own time limit, so one that hangs leaves
# the others their time; each one's whole output goes to OUT/<check>.log, its tail to stdout,
# with the time and load average it started at. docs/benchmarks.md's GPU section holds the
# figures.
#
#     ./scripts/gpu_checks.sh /tmp/gpu-checks      # OUT (default: ./gpu-checks)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu-checks}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if ! python3 -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  echo "gpu_checks.sh: no CUDA device here; nothing checked" >&2
  exit 2
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version())" |
  tee -a "$out/gpu.txt"
failed=0

check() {  # check NAME SECONDS COMMAND...
  local name=$1 limit=$2
  shift 2
  echo "== $name: $* ($(date +%T), load average $(cut -d' ' -f1-3 /proc/loadavg))"
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  tail -n 20 "$out/$name.log"
  echo "== $name: rc $rc$([ "$rc" = 124 ] && echo ", stopped at ${limit} s")"
  [ "$rc" = 0 ] || failed=1
}

check bench_gpu_eager 100 python3 scripts/bench_gpu.py --steps 60 --warmup 15
check bench_gpu_compile 150 python3 scripts/bench_gpu.py --steps 60 --warmup 20 --compile
check cuda_tests 100 python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_cuda.py \
  tests/test_benchmarks.py
check bench_parity 160 python3 scripts/bench_parity.py --device cuda \
  --rows ddp ddp+defaults fsdp zero3 --repeats 1 --steps 30
exit "$failed"
