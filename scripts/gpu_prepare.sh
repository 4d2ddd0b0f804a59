#!/usr/bin/env bash
# Run HERE (the development machine: Debian 12, root, apt) before a session on the GPU
# machine (the device tool's `run`), which has no network and no MPI or spdlog. Downloads
# Debian 12's OpenMPI, PMIx, spdlog and fmt with every library that mpirun, orted and
# libmpi load into .deps/ (git-ignored; about 8 MiB), checks by unpacking them into a
# temporary prefix (never into /) that the core binaries and libraries find every
# library they need in it, and prints the device-tool call to make next. There,
# scripts/gpu_session.sh (through scripts/gpu_env.sh) unpacks them into /opt/deps.
set -euo pipefail
cd "$(dirname "$0")/.."

# Unpacked there into /opt/deps, always.
PACKAGES=(
  openmpi-bin openmpi-common libopenmpi3 libopenmpi-dev  # mpirun/orted, MCA components, mpi.h
  libpmix2 libmunge2                                      # PMIx (the ext3x component), its munge
  libhwloc15 libevent-core-2.1-7 libevent-pthreads-2.1-7  # libopen-pal/libopen-rte/libmpi
  # loaded by MCA components (ofi, ucx, psm, psm2, openib, verbs, reachable_netlink): a
  # component whose library is missing prints a warning when Open MPI opens it
  libfabric1 libucx0 libpsm2-2 libpsm-infinipath1 libibverbs1 librdmacm1 libnl-3-200
  libnl-route-3-200 libnuma1
  libspdlog-dev libspdlog1.10 libfmt-dev libfmt9          # headers, CMake configs, .so
)
# In Debian's base system but possibly not in a minimal (Ubuntu) GPU image: there each is
# copied into /opt/deps only when the machine lacks its library (gpu_env.sh), never
# shadowing the machine's own. libudev1: libhwloc; zlib1g: libopen-rte, PMIx's zlib
# component; libuuid1: libpsm_infinipath; libatomic1: libfabric.
FALLBACK=(libudev1 zlib1g libuuid1 libatomic1)
# Left out on purpose: libltdl7 (nothing links it), libhwloc-plugins with libpciaccess0
# and libxnvctrl0 (hwloc's optional plugins, looked up under /usr only: not needed),
# ibverbs-providers (libfabric's EFA and UCX's mlx5 transports; ofi and ucx are off in
# openmpi-mca-params.conf and the tests use ob1 over self,vader).

download() {  # download DIR PACKAGE...
  local dir="$1"
  shift
  (cd "$dir" && apt-get download "$@")
}

tmp="$(mktemp -d /tmp/rannc-deps.XXXXXX)"
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/debs/fallback"  # (apt warns that it downloads "unsandboxed as root": harmless)
if ! download "$tmp/debs" "${PACKAGES[@]}" || ! download "$tmp/debs/fallback" "${FALLBACK[@]}"; then
  echo "apt-get download failed; apt-get update and again" >&2
  apt-get update -q
  rm -f "$tmp"/debs/*.deb "$tmp"/debs/fallback/*.deb
  download "$tmp/debs" "${PACKAGES[@]}"
  download "$tmp/debs/fallback" "${FALLBACK[@]}"
fi

# ---- check: unpack into a temporary prefix (never into /) and follow the libraries ----
chk="$tmp/prefix"
mkdir -p "$chk"
for f in "$tmp"/debs/*.deb "$tmp"/debs/fallback/*.deb; do dpkg -x "$f" "$chk"; done
L="$chk/usr/lib/x86_64-linux-gnu"
for f in "$chk/usr/bin/mpirun.openmpi" "$chk/usr/bin/mpiexec.openmpi" "$chk/usr/bin/mpicc.openmpi" \
    "$chk/usr/bin/mpicxx.openmpi" "$L/openmpi/include/mpi.h" "$L/cmake/spdlog/spdlogConfig.cmake" \
    "$L/cmake/fmt/fmt-config.cmake" "$chk/etc/openmpi/openmpi-mca-params.conf" \
    "$L/pmix2/lib/pmix/pmix_mca_pcompress_zlib.so"; do
  [[ -e "$f" ]] || { echo "missing from the packages: ${f#"$chk"}" >&2; exit 1; }
done
# Every machine has these (glibc, the C++ runtime torch itself links).
BASE=" libc.so.6 libm.so.6 libdl.so.2 libpthread.so.0 librt.so.1 ld-linux-x86-64.so.2 libstdc++.so.6 libgcc_s.so.1 "
needed() { readelf -d "$1" 2> /dev/null | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p'; }
locate_lib() {
  local d
  for d in "$L" "$L/openmpi/lib" "$L/pmix2/lib" "$chk/lib/x86_64-linux-gnu"; do
    [[ -e "$d/$1" ]] && { echo "$d/$1"; return 0; }
  done
  return 1
}
# What mpirun (orterun), orted, libmpi with the components a one-host run opens, and
# spdlog load, followed through their libraries.
C="$L/openmpi/lib/openmpi3"
queue=("$chk/usr/bin/orterun" "$chk/usr/bin/orted" "$chk/usr/bin/ompi_info" "$L/libmpi.so.40"
  "$L/libspdlog.so.1.10" "$C/mca_pmix_ext3x.so" "$C/mca_btl_vader.so" "$C/mca_btl_self.so"
  "$C/mca_pml_ob1.so" "$C/mca_ess_hnp.so" "$C/mca_odls_default.so" "$C/mca_plm_rsh.so"
  "$C/mca_oob_tcp.so" "$C/mca_shmem_mmap.so" "$C/mca_plm_isolated.so" "$L"/pmix2/lib/pmix/*.so)
declare -A seen=()
missing=()
while ((${#queue[@]})); do
  f="${queue[0]}"
  queue=("${queue[@]:1}")
  [[ -e "$f" ]] || { missing+=("${f#"$chk"} (file)"); continue; }
  for so in $(needed "$f"); do
    [[ "$BASE" == *" $so "* || -n "${seen[$so]:-}" ]] && continue
    seen[$so]=1
    if p="$(locate_lib "$so")"; then queue+=("$p"); else missing+=("$so (for $(basename "$f"))"); fi
  done
done
if ((${#missing[@]})); then
  printf 'not in the packages: %s\n' "${missing[@]}" >&2
  exit 1
fi
echo "check: mpirun, orted, libmpi, the one-host components and spdlog find all ${#seen[@]} libraries they load in the packages (besides glibc and libstdc++)"

rm -rf .deps/*.deb .deps/fallback
mkdir -p .deps/fallback
mv "$tmp"/debs/*.deb .deps/
mv "$tmp"/debs/fallback/*.deb .deps/fallback/
size_kib="$(du -sk .deps | cut -f1)"
du -sh .deps
((size_kib < 60 * 1024)) || { echo ".deps is over 60 MiB: the device tool carries at most 64 MiB" >&2; exit 1; }

cat << 'EOF'

Next, the device tool (GPU machine; one call, at most 600 s):
  run(command="bash scripts/gpu_session.sh", carry=[".deps"], timeout_s=600)
With the extension from an earlier session's $OUT put back at python/rannc/ (it skips the
build; RANNC_GPU_REBUILD=1 forces one):
  run(command="bash scripts/gpu_session.sh",
      carry=[".deps", "python/rannc/_C.cpython-312-x86_64-linux-gnu.so"], timeout_s=600)
Parts: RANNC_GPU_PARTS="tests hf models bench plans plans_large table" (default all; tests alone may fill a first call), e.g.
  command="RANNC_GPU_PARTS='bench table' bash scripts/gpu_session.sh"
EOF
