#!/usr/bin/env bash
# Builds and installs the Python package (extension rannc._C) against the installed torch,
# and the plain C++ test binaries. Incremental: build/ is kept, ccache caches objects.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
# --no-build-isolation: build against the torch already installed instead of letting pip
# fetch another one into a temporary environment.
"$PYTHON" -m pip install -q --no-build-isolation .
cmake -S . -B build/cpp -G Ninja -DRANNC_WITH_TORCH=OFF -DRANNC_BUILD_TESTS=ON >/dev/null
cmake --build build/cpp -j "${RANNC_BUILD_JOBS:-$(nproc)}"
