#!/usr/bin/env bash
# Run THERE, on the GPU machine, from the repository root, with .deps carried (made by
# scripts/gpu_prepare.sh here): unpacks OpenMPI and spdlog, builds rannc against that
# machine's CUDA torch, runs the GPU tests (tests/gpu), the one-rank CUDA benchmark
# against plain PyTorch and the CUDA profile error table. Results go to $OUT (the device
# tool brings them back). Each part is timed and a failure does not stop the others.
#   RANNC_GPU_PARTS="tests bench table" (default: all three)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PYTHONUNBUFFERED=1
for f in .deps/*.deb; do dpkg -x "$f" /; done
ldconfig
PARTS="${RANNC_GPU_PARTS:-tests bench table}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
start=$(date +%s)
RANNC_BUILD_JOBS="$(nproc)" python3 setup.py -q build_ext --inplace > "$OUT/build.log" 2>&1 \
  || { tail -50 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - start )) s"
export PYTHONPATH="$PWD/python:${PYTHONPATH:-}"
rc=0
if [[ " $PARTS " == *" tests "* ]]; then
  python3 -m pytest -q tests/gpu -x 2>&1 | tee "$OUT/tests_gpu.log" | tail -30 || rc=1
fi
if [[ " $PARTS " == *" bench "* ]]; then
  python3 bench/runtime.py --device cuda --out "$OUT" 2>&1 | tail -30 || rc=1
fi
if [[ " $PARTS " == *" table "* ]]; then
  python3 bench/profile_vs_stage.py --device cuda 2>&1 | tail -30 || rc=1
  cp bench/results/profile_vs_stage_cuda.* "$OUT/" 2>/dev/null
fi
echo "total: $(( $(date +%s) - start )) s"
exit $rc
