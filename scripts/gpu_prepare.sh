#!/usr/bin/env bash
# Run HERE (the development machine) before a session on the GPU machine (the `device`
# tool): downloads what that machine lacks (OpenMPI, spdlog, fmt, as Debian 12 packages)
# into .deps/ (git-ignored). Then call the device tool's `run` with carry [".deps"] and the
# command `bash scripts/gpu_session.sh` (see there).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .deps
PACKAGES=(openmpi-bin openmpi-common libopenmpi3 libopenmpi-dev libpmix2 libhwloc15
  libevent-core-2.1-7 libevent-pthreads-2.1-7 libfabric1 libucx0 libpsm2-2 libpsm-infinipath1
  libibverbs1 librdmacm1 libnl-3-200 libnl-route-3-200 libnuma1 libltdl7 libmunge2
  libpciaccess0 libxnvctrl0 libspdlog-dev libspdlog1.10 libfmt-dev libfmt9)
(cd .deps && apt-get download "${PACKAGES[@]}")
du -sh .deps
