#!/usr/bin/env bash
# Compiles the CUDA/NCCL path on a machine without a GPU: a virtual environment with a
# CUDA build of torch (and NVIDIA's NCCL wheel, which it pulls in), then the extension
# against it in build/cuda. Nothing built here runs without a GPU; this checks that the
# NCCL data plane, the CUDA profiler (csrc/profile/cuda_meter.cpp) and the rest compile
# against CUDA torch. Needs nvcc (CUDA_HOME or
# /usr/local/cuda). Not part of CI (several GB of wheels).
#
#   bash scripts/check_cuda_build.sh --syntax   (seconds, nothing to download)
# only parses the translation units with CUDA code (-fsyntax-only, RANNC_HAVE_CUDA) against
# this machine's CPU torch headers and the local CUDA toolkit's: a quick check after
# editing them (session 14). The NCCL units are parsed too where nccl.h is found
# (NCCL_INCLUDE_DIR, see below).
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ "${1:-}" == "--syntax" ]]; then
  CUDA_HOME="${CUDA_HOME:-$(ls -d /usr/local/cuda /usr/local/cuda-* 2>/dev/null | head -1)}"
  TORCH_INC="$(python3 -c "import os, torch; print(os.path.dirname(torch.__file__) + '/include')")"
  STUB="$(mktemp -d)"
  trap 'rm -rf "$STUB"' EXIT
  # CPU wheels ship c10/cuda's headers but not the one CMake generates for CUDA builds.
  mkdir -p "$STUB/c10/cuda/impl"
  printf '#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n' > "$STUB/c10/cuda/impl/cuda_cmake_macros.h"
  FLAGS=(-std=c++20 -fsyntax-only -Wno-attributes -DRANNC_HAVE_CUDA -include torch/torch.h -I"$STUB" -Icsrc -Ibench
         -I"$TORCH_INC" -I"$TORCH_INC/torch/csrc/api/include" -I"$CUDA_HOME/include"
         -I"$(python3 -c "import sysconfig; print(sysconfig.get_paths()['include'])")")
  FLAGS+=($(mpicc -showme:incdirs 2>/dev/null | sed 's/^/-I/; s/ / -I/g'))
  # More header folders, colon-separated: the NCCL units reach ATen/cuda/CUDAContext.h,
  # which wants cuBLAS, cuSPARSE and cuSOLVER headers a bare nvcc install lacks (the
  # include/ folders of the nvidia-*-cu12 wheels do).
  INCLUDES="${RANNC_CUDA_INCLUDES:-}"
  for dir in ${INCLUDES//:/ }; do FLAGS+=(-I"$dir"); done
  UNITS=(csrc/profile/cuda_meter.cpp csrc/profile/device_meter.cpp csrc/bind/profile_bindings.cpp)
  # nccl.h: the toolkit's, the system's, or NCCL_INCLUDE_DIR (the include/ folder of the
  # nvidia-nccl-cu12 wheel: `pip download --no-deps nvidia-nccl-cu12`, then unzip it).
  NCCL_INC="$(ls -d "${NCCL_INCLUDE_DIR:-/nonexistent}/nccl.h" "$CUDA_HOME/include/nccl.h" \
    /usr/include/nccl.h 2>/dev/null | head -1 || true)"
  if [[ -n "$NCCL_INC" ]]; then
    FLAGS+=(-DRANNC_HAVE_NCCL -I"$(dirname "$NCCL_INC")")
    UNITS+=(csrc/comm/nccl_communicator.cpp csrc/runtime/channels.cpp csrc/bind/module.cpp)
  else
    echo "no nccl.h here: the NCCL units are not parsed"
  fi
  for unit in "${UNITS[@]}"; do
    g++ "${FLAGS[@]}" "$unit"
    echo "parsed with CUDA: $unit"
  done
  exit 0
fi
VENV="${RANNC_CUDA_VENV:-$PWD/build/cuda-venv}"
TORCH_SPEC="${RANNC_CUDA_TORCH:-torch==2.14.1}"
CUDA_HOME="${CUDA_HOME:-$(ls -d /usr/local/cuda /usr/local/cuda-* 2>/dev/null | head -1)}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -c "import torch" 2>/dev/null || "$VENV/bin/pip" install -q "$TORCH_SPEC" numpy
# torch's CMake wants libnvrtc; NVIDIA's wheels have it when the local toolkit does not.
NVRTC="$("$VENV/bin/python" -c "import glob, nvidia; print((sorted(glob.glob(nvidia.__path__[0] + '/*/lib/libnvrtc.so*')) + [''])[0])")"
EXTRA=()
[ -n "$NVRTC" ] && [ ! -e "$CUDA_HOME/lib64/libnvrtc.so" ] && EXTRA+=("-DCUDA_nvrtc_LIBRARY=$NVRTC")
# No GPU to query: name the architecture (Hopper) instead of detecting it.
TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" cmake -S . -B build/cuda -G Ninja \
  -DPython_EXECUTABLE="$VENV/bin/python" -DRANNC_COPY_TO_SOURCE=OFF \
  -DCUDA_TOOLKIT_ROOT_DIR="$CUDA_HOME" -DCUDAToolkit_ROOT="$CUDA_HOME" \
  -DCMAKE_CUDA_COMPILER="$CUDA_HOME/bin/nvcc" "${EXTRA[@]}"
cmake --build build/cuda --target _C -j "${RANNC_BUILD_JOBS:-$(nproc)}"
grep -q "RANNC_HAVE_NCCL" build/cuda/build.ninja && echo "CUDA build with the NCCL data plane: OK"
grep -q "RANNC_HAVE_CUDA" build/cuda/build.ninja && echo "CUDA build with the CUDA profiler: OK"
