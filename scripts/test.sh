#!/usr/bin/env bash
# The whole test suite from a fresh Debian 12 machine: installs what is missing, builds,
# runs the GoogleTest suites (ctest) and the pytest suites.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh
bash scripts/build.sh
(cd build/cpp && ctest --output-on-failure)
export OMP_NUM_THREADS=1
"${PYTHON:-python3}" -m pytest -q tests/python "$@"
