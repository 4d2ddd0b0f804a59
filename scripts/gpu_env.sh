# shellcheck shell=bash
# Sourced, not run: `source scripts/gpu_env.sh` on the GPU machine (the device tool), from
# the repository root, with .deps carried (made here by scripts/gpu_prepare.sh).
# scripts/gpu_session.sh sources it; an interactive follow-up call sources it too, e.g.
#   source scripts/gpu_env.sh && python3 -m pytest -q tests/gpu -k nccl
# Unpacks the Debian OpenMPI/spdlog/fmt packages in .deps into a prefix of their own (once
# per machine and set of packages: $PREFIX/.unpacked lists them) and sets what the build,
# mpirun and the tests need to find them there. Never unpacks into / (that replaces the
# machine's /lib link, and then no program links).
#   RANNC_DEPS_PREFIX   where to unpack, under /opt or /tmp (default /opt/deps)
#   RANNC_DEPS_DIR      where the .deb files are (default <repo>/.deps)
# Returns non-zero (and leaves the environment as it was) when .deps has no packages.

_rannc_gpu_env() {
  local root prefix debs lib f name tmp packages
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  prefix="${RANNC_DEPS_PREFIX:-/opt/deps}"
  debs="${RANNC_DEPS_DIR:-$root/.deps}"
  lib="$prefix/usr/lib/x86_64-linux-gnu"
  if ! compgen -G "$debs/*.deb" > /dev/null; then
    echo "gpu_env: no .deb files in $debs (run scripts/gpu_prepare.sh here and carry .deps)" >&2
    return 1
  fi
  packages="$(cd "$debs" && ls -1 ./*.deb fallback/*.deb 2> /dev/null)"
  # Unpacked once per machine: again only when the carried packages changed.
  if [[ "$(cat "$prefix/.unpacked" 2> /dev/null)" != "$packages" ]]; then
    case "$prefix" in
      /opt/* | /tmp/*) ;;
      *) echo "gpu_env: refusing prefix '$prefix' (use one under /opt or /tmp)" >&2; return 1 ;;
    esac
    [[ -e "$prefix/.unpacked" ]] && rm -rf "$prefix"  # ours, from older packages
    mkdir -p "$prefix"
    for f in "$debs"/*.deb; do
      dpkg -x "$f" "$prefix" || { echo "gpu_env: dpkg -x $f failed" >&2; return 1; }
    done
    # Fallback libraries (.deps/fallback): copied in only when this machine lacks them, so
    # they never shadow the machine's own copies (LD_LIBRARY_PATH comes before the system).
    if compgen -G "$debs/fallback/*.deb" > /dev/null; then
      tmp="$(mktemp -d)"
      for f in "$debs"/fallback/*.deb; do dpkg -x "$f" "$tmp"; done
      for f in "$tmp"/usr/lib/x86_64-linux-gnu/lib*.so.* "$tmp"/lib/x86_64-linux-gnu/lib*.so.*; do
        [[ -L "$f" ]] || continue  # the soname links; their targets follow
        name="$(basename "$f")"
        if ! ldconfig -p 2> /dev/null | grep -q "^[[:space:]]*$name " \
            && [[ ! -e "/usr/lib/x86_64-linux-gnu/$name" && ! -e "/lib/x86_64-linux-gnu/$name" ]]; then
          cp -a "$f" "$(readlink -f "$f")" "$lib/" && echo "gpu_env: carried $name (the machine lacks it)"
        fi
      done
      rm -rf "$tmp"
    fi
    # Debian makes these names with update-alternatives, which dpkg -x skips.
    for name in mpirun mpiexec mpicc mpicxx mpic++; do
      [[ -e "$prefix/usr/bin/$name.openmpi" ]] && ln -sfn "$name.openmpi" "$prefix/usr/bin/$name"
    done
    printf '%s\n' "$packages" > "$prefix/.unpacked"
  fi

  # Open MPI and PMIx were built for /usr: point them at the prefix (binaries, MCA
  # components, help texts, openmpi-mca-params.conf, which turns off ucx/ofi/openib).
  export OPAL_PREFIX="$prefix/usr"
  export OPAL_SYSCONFDIR="$prefix/etc/openmpi"
  export PMIX_MCA_mca_base_component_path="$lib/pmix2/lib/pmix"
  case ":$PATH:" in *":$prefix/usr/bin:"*) ;; *) export PATH="$prefix/usr/bin:$PATH" ;; esac
  case ":${LD_LIBRARY_PATH:-}:" in
    *":$lib:"*) ;;
    *) export LD_LIBRARY_PATH="$lib:$lib/openmpi/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ;;
  esac
  case ":${CMAKE_PREFIX_PATH:-}:" in
    *":$prefix/usr:"*) ;;
    *) export CMAKE_PREFIX_PATH="$prefix/usr${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}" ;;
  esac
  export MPI_HOME="$prefix/usr"  # CMake's FindMPI: $MPI_HOME/bin/mpicc
  # The image's default compiler (/opt/gcc/bin/g++) is a wrapper whose extensions segfault
  # in libstdc++: build with the system compiler.
  if [[ -x /usr/bin/g++ ]]; then export CC=/usr/bin/gcc CXX=/usr/bin/g++; fi
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  # The same as tests/python/mpirun.py passes with --mca (one host, shared memory, no
  # ptrace-based single copy, which containers refuse). Note: bench/runtime.py's CPU
  # pipeline compares single copy with copy in/out; unset the last one for that.
  export OMPI_MCA_pml=ob1 OMPI_MCA_btl=self,vader OMPI_MCA_btl_vader_single_copy_mechanism=none
  # One host: start the ranks without ssh (without it, the default launcher aborts with
  # "plm_rsh_agent: ssh : rsh ... could not be found").
  export OMPI_MCA_plm=isolated
  case ":${PYTHONPATH:-}:" in
    *":$root/python:"*) ;;
    *) export PYTHONPATH="$root/python${PYTHONPATH:+:$PYTHONPATH}" ;;
  esac
  export PYTHONUNBUFFERED=1
}

_rannc_gpu_env
