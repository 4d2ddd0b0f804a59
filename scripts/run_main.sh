#!/usr/bin/env bash
# The main job: installs what is missing, builds, and trains the example GPT with rannc on
# 4 CPU ranks under mpirun (2 pipeline stages, 2 replicas each). Rank 0 prints the plan and
# a falling loss. Extra arguments go to examples/train.py (--model bert|resnet, --steps ...).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh
bash scripts/build.sh
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
export PYTHONPATH="$PWD/python:${PYTHONPATH:-}"
mpirun --oversubscribe -np "${RANNC_RANKS:-4}" --mca btl self,vader \
  --mca btl_vader_single_copy_mechanism none \
  "${PYTHON:-python3}" examples/train.py --model gpt --stages 2 --steps 40 "$@"
