#!/usr/bin/env bash
# Set up (scripts/setup.sh with the test, hf, ray, kubernetes, eval and torchft extras, and the
# system packages only tests use) and run the whole test suite; extra arguments go to pytest.
#
#     ./scripts/test.sh                      # what .ci/run runs: the suite on 2 workers, then
#                                            # the tests marked alone (timing) by themselves
#     ./scripts/test.sh tests/test_ddp.py    # one file (one process; add -n 2 for two)
#
# System packages, where this runs as root with apt-get (elsewhere the tests that need them skip,
# saying why): SLURM and munge for tests/test_slurm.py (a controller and a node daemon on
# localhost), Debian's chromium for tests/test_report.py (the report opened headless), jemalloc
# and tcmalloc for tests/test_host_memory.py (launcher.allocator; auto then takes tcmalloc).
set -euo pipefail
cd "$(dirname "$0")/.."
# DeepSpeed's CPU ops built beside the virtual environment, where tests/conftest.py looks: a
# second checkout on this machine (a CI clone) builds its own instead of rebuilding the shared
# ~/.cache/torch_extensions against its include paths.
export TORCH_EXTENSIONS_DIR="$PWD/.venv/torch_extensions"
PLAIT_EXTRAS=test,hf,ray,kubernetes,eval,torchft ./scripts/setup.sh
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  wanted=()
  [ -x /usr/sbin/slurmd ] || wanted+=(slurm-wlm munge)
  command -v chromium >/dev/null 2>&1 || wanted+=(chromium)
  ldconfig -p | grep -q libjemalloc.so.2 || wanted+=(libjemalloc2)
  ldconfig -p | grep -q libtcmalloc_minimal.so.4 || wanted+=(libtcmalloc-minimal4)
  if [ ${#wanted[@]} -gt 0 ]; then
    { DEBIAN_FRONTEND=noninteractive apt-get update -qq &&
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${wanted[@]}" >/dev/null; } ||
      echo "test.sh: ${wanted[*]} not installed (apt failed); the tests that need them skip" >&2
  fi
fi
. .venv/bin/activate
export DS_ACCELERATOR=cpu
if [ $# -gt 0 ]; then
  exec python -m pytest -q --durations=25 "$@"
fi
# The whole suite: two workers (pytest-xdist), then the tests marked alone (they assert on
# timing: pyproject.toml's markers) with nothing beside them. The two workers share the cores:
# a run's launcher gives its workers cores / nproc_per_node threads each, which two runs at
# once would double; one intra-op thread per process instead (a one-process run's second
# OpenMP thread spins between operators on a core the other worker's run needs: 16% longer,
# measured on two test files).
failed=0
OMP_NUM_THREADS=1 python -m pytest -q -n 2 --dist loadgroup -m "not alone" --durations=25 ||
  failed=$?
python -m pytest -q -m alone --durations=10 || failed=$?
exit "$failed"
