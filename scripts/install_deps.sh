#!/usr/bin/env bash
# Installs what rannc needs on a fresh Debian 12 machine (as root, or with sudo):
# compilers, CMake, Ninja, ccache, OpenMPI, spdlog, GoogleTest, then torch 2.13.0 (CPU),
# pytest and transformers 5.23.0 (the tests' Hugging Face models). Skips what is already
# there, so it is cheap to run again.
set -euo pipefail

SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
PYTHON="${PYTHON:-python3}"

need_apt=()
for pkg in build-essential cmake ninja-build ccache libopenmpi-dev openmpi-bin libspdlog-dev \
           libgtest-dev git; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || need_apt+=("$pkg")
done
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "[install_deps] apt: ${need_apt[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

# Python headers for the extension (pyenv/python.org builds ship them; Debian's python3 does not).
if ! "$PYTHON" -c "import sysconfig, os, sys; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')))"; then
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq python3-dev >/dev/null
fi

if ! "$PYTHON" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null; then
  echo "[install_deps] pip: torch==2.13.0"
  "$PYTHON" -m pip install -q torch==2.13.0
fi
"$PYTHON" -c "import pytest" 2>/dev/null || "$PYTHON" -m pip install -q pytest
# The tests' Hugging Face models (tests/python/hf_zoo.py); torch pinned so pip keeps it.
if ! "$PYTHON" -c "import transformers, sys; sys.exit(transformers.__version__ != '5.23.0')" 2>/dev/null; then
  echo "[install_deps] pip: transformers==5.23.0"
  "$PYTHON" -m pip install -q transformers==5.23.0 torch==2.13.0
fi
# transformers' Trainer (tests/python/mpi/trainer_check.py) runs on accelerate
if ! "$PYTHON" -c "import accelerate, sys; sys.exit(accelerate.__version__ != '1.15.0')" 2>/dev/null; then
  echo "[install_deps] pip: accelerate==1.15.0"
  "$PYTHON" -m pip install -q accelerate==1.15.0 torch==2.13.0
fi
# PEFT's LoRA adapters (tests/python/mpi/peft_check.py)
if ! "$PYTHON" -c "import peft, sys; sys.exit(peft.__version__ != '0.21.2')" 2>/dev/null; then
  echo "[install_deps] pip: peft==0.21.2"
  "$PYTHON" -m pip install -q peft==0.21.2 torch==2.13.0 transformers==5.23.0 accelerate==1.15.0
fi
"$PYTHON" -c "import numpy" 2>/dev/null || "$PYTHON" -m pip install -q numpy
