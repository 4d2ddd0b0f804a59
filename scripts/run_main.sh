#!/usr/bin/env bash
# The main job: installs what is missing, builds, and traces the example transformer into
# rannc's IR, printing its summary and checking the IR runs like the model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh
bash scripts/build.sh
OMP_NUM_THREADS=1 "${PYTHON:-python3}" examples/trace_transformer.py "$@"
