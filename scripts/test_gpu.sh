#!/usr/bin/env bash
# The GPU tests (tests/gpu) on a machine with a CUDA device: builds the extension in
# place against this machine's (CUDA) torch, then runs them. Fails, never skips, when there
# is no CUDA device or the build has no CUDA support. Not part of scripts/test.sh (CI has
# no GPU). The CUDA error table: python bench/profile_vs_stage.py --device cuda.
# Needs OpenMPI and spdlog installed; on the lent GPU machine (device tool) use
# scripts/gpu_session.sh instead, or `source scripts/gpu_env.sh` first.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
RANNC_BUILD_JOBS="${RANNC_BUILD_JOBS:-$(nproc)}" "$PYTHON" setup.py -q build_ext --inplace
"$PYTHON" -m pytest -q tests/gpu "$@"
