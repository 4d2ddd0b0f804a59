#!/usr/bin/env bash
# Run THERE, on the lent GPU machine (the device tool's `run`), from the repository root,
# with .deps carried (made here by scripts/gpu_prepare.sh):
#   run(command="bash scripts/gpu_session.sh", carry=[".deps"], timeout_s=600)
# One call does everything and brings it back in $OUT (at most 8 files):
#   summary.txt   GPU, driver, torch/CUDA/NCCL versions, then one line per part:
#                 "PART: passed|failed|none|skipped (N s)"
#   build.log     the build (or why it was skipped)
#   log.txt       the output of every part, one after another under ===== headers
#   _C.cpython-3XX-x86_64-linux-gnu.so   the extension built there (when built)
#   runtime_cuda.json, profile_vs_stage_cuda.md/.json, plan_time_cuda.md/.json   the benchmark results
# Steps: source scripts/gpu_env.sh (unpacks .deps into /opt/deps, never into /; sets
# PATH, LD_LIBRARY_PATH, OPAL_PREFIX, CMAKE_PREFIX_PATH, CC/CXX=/usr/bin/gcc/g++, the
# MCA settings, PYTHONPATH=python); build rannc against that machine's CUDA torch unless
# python/rannc/_C*.so for its python imports with CUDA (carry it from an earlier $OUT to
# skip the 2-minute build; RANNC_GPU_REBUILD=1 builds anyway, e.g. after C++ changes);
# then the parts, in this order:
#   tests   bash scripts/gpu_tests.sh (tests/gpu: the module's cases in parallel shards,
#           then the profiler's alone)
#   hf      python3 -m pytest -v tests/python -k "hf or transformers"  ("none" if no test matches)
#   models  python3 bench/hf_models.py --device cuda [--precision bf16 | --eval] (72
#           transformers architectures planned into 3 stages with CUDA profiles: training in
#           fp32, under bf16 autocast, and eval; one line per model in log.txt)
#   bench   python3 bench/runtime.py --device cuda --out $OUT  (the GPT, then the speed
#           issue's BERT-large-like model in fp32 and bf16 with a torch.profiler summary)
#   plans   python3 bench/plan_time.py --device cuda --skip-whole (plans in seconds)
#   table   python3 bench/profile_vs_stage.py --device cuda $RANNC_GPU_TABLE_ARGS
# Each part runs under `timeout` in a session of its own (what it leaves running is
# killed); a failing part does not stop the others. All of it fits RANNC_GPU_BUDGET
# seconds (default 570; the device tool stops a command at 600): a part gets at most its
# own limit and what is left, and is skipped when less than 30 s is left.
#   RANNC_GPU_PARTS="bench tests plans plans_large models hf table" (default: all, in this order)
#   RANNC_GPU_LIMIT_<PART>=seconds overrides a part's own limit (RANNC_GPU_LIMIT_TESTS=240).
# A session's device time is 15 minutes, the machine's start included: one call of this
# script is all it gets, so pick the parts and limits that answer the open issues first.
# Exits non-zero when a part failed or was skipped; prints summary.txt last.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
START=$(date +%s)
OUT="${OUT:-/tmp/rannc-gpu-out}"
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
LOG="$OUT/log.txt"
BUILD_LOG="$OUT/build.log"
: > "$SUMMARY"
: > "$LOG"
: > "$BUILD_LOG"
BUDGET="${RANNC_GPU_BUDGET:-570}"
# the order the open issues need them in: the speed and mixed-precision measurements first
PARTS=" ${RANNC_GPU_PARTS:-bench tests plans plans_large models hf table} "
# a failed test's cause the moment it fails (tests/python/report.py): a part stopped by its
# limit never reaches pytest's summary
export RANNC_FAILURES_AT_ONCE=1
failed=0

note() { echo "$*" | tee -a "$SUMMARY"; }

# run_part NAME LIMIT_S LOGFILE COMMAND: COMMAND (bash) under timeout; one summary line.
# Returns the command's exit status.
run_part() {
  local name="$1" limit="$2" log="$3" cmd="$4" t rc begin secs offset pid
  t=$((BUDGET - ($(date +%s) - START) - 10))
  ((t > limit)) && t=$limit
  if ((t < 30)); then
    note "$name: skipped (no time left of the $BUDGET s budget)"
    failed=1
    return 1
  fi
  offset=$(stat -c %s "$log")
  printf '\n===== %s (timeout %s s): %s\n' "$name" "$t" "$cmd" >> "$log"
  begin=$(date +%s)
  # A session of its own: afterwards nothing it started (mpirun, ranks) keeps running.
  setsid -w timeout -k 10 "$t" bash -c "$cmd" >> "$log" 2>&1 < /dev/null &
  pid=$!
  wait "$pid"
  rc=$?
  pkill -KILL -s "$pid" 2> /dev/null
  secs=$(($(date +%s) - begin))
  if ((rc == 0)); then
    note "$name: passed ($secs s)"
  elif ((rc == 5)) && [[ "$cmd" == *pytest* ]]; then
    note "$name: none (no test collected) ($secs s)"
  else
    if ((rc == 124 || rc == 137)); then
      note "$name: failed (timed out after $t s) ($secs s)"
    else
      note "$name: failed (exit $rc) ($secs s)"
    fi
    failed=1
    echo "----- $name: last lines of $(basename "$log")"
    tail -c +$((offset + 1)) "$log" | tail -n 25
  fi
  return "$rc"
}

# ---- the machine -----------------------------------------------------------------------
{
  echo "rannc GPU session $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) CPUs"
  echo "gpu: $(timeout 30 nvidia-smi --query-gpu=name,memory.total,driver_version \
    --format=csv,noheader 2>&1 | paste -sd ';')"
  timeout 120 python3 -c "
import sys, torch
cuda = torch.cuda.is_available()
nccl = '.'.join(map(str, torch.cuda.nccl.version())) if cuda else '-'
print('python', sys.version.split()[0], '| torch', torch.__version__, '| CUDA', torch.version.cuda,
      '| device', torch.cuda.get_device_name() if cuda else 'none', '| NCCL', nccl)
import importlib.metadata as md
def version(p):
    try:
        return md.version(p)
    except md.PackageNotFoundError:
        return 'none'
print(' | '.join(f'{p} {version(p)}' for p in ('transformers', 'accelerate', 'peft', 'pytest')))" 2>&1 | tail -4
  # compare with the same command here: which sources this session built or ran
  echo "sources: $(find csrc CMakeLists.txt setup.py -type f | LC_ALL=C sort | xargs cat \
    | sha256sum | cut -c1-12) (C++: csrc CMakeLists.txt setup.py), $(find python bench tests \
    -name '*.py' | LC_ALL=C sort | xargs cat | sha256sum | cut -c1-12) (python)"
} | tee -a "$SUMMARY"

# ---- Open MPI, spdlog, fmt from .deps ----------------------------------------------------
begin=$(date +%s)
# shellcheck source=scripts/gpu_env.sh
if source scripts/gpu_env.sh >> "$BUILD_LOG" 2>&1; then
  note "deps: $(mpirun --version 2>&1 | head -1) in ${RANNC_DEPS_PREFIX:-/opt/deps} ($(($(date +%s) - begin)) s)"
else
  note "deps: failed ($(tail -1 "$BUILD_LOG"))"
  failed=1
fi

# ---- the extension -----------------------------------------------------------------------
EXT="$(python3 -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")"
SO="python/rannc/_C$EXT"
have_c=0
if [[ -z "${RANNC_GPU_REBUILD:-}" && -f "$SO" ]] && timeout 120 python3 -c "
import sys, rannc._C as c
sys.exit(0 if c.has_cuda_profiler else 'built without CUDA')" >> "$BUILD_LOG" 2>&1; then
  note "build: skipped ($SO is there and imports with CUDA; RANNC_GPU_REBUILD=1 rebuilds)"
  have_c=1
else
  # CMake keeps the compiler of its first configure: start afresh if build/py used another.
  if [[ -f build/py/CMakeCache.txt ]] \
      && ! grep -qx "CMAKE_CXX_COMPILER:[A-Z]*=${CXX:-/usr/bin/g++}" build/py/CMakeCache.txt; then
    rm -rf build/py
  fi
  if run_part build 420 "$BUILD_LOG" "RANNC_BUILD_JOBS=$(nproc) python3 setup.py -q build_ext \
--inplace && python3 -c 'import rannc._C as c; print(\"has_cuda_profiler\", c.has_cuda_profiler)'"; then
    have_c=1
    cp "$SO" "$OUT/"
    # the device tool brings back files of at most 16 MiB
    if (($(stat -c %s "$SO") > 16 * 1024 * 1024)); then strip --strip-debug "$OUT/$(basename "$SO")"; fi
  fi
fi

# ---- the parts ---------------------------------------------------------------------------
part() {  # part NAME LIMIT_S COMMAND (RANNC_GPU_LIMIT_<NAME> overrides LIMIT_S)
  [[ "$PARTS" == *" $1 "* ]] || return 0
  if ((!have_c)); then
    note "$1: skipped (no usable build)"
    failed=1
    return 0
  fi
  local override="RANNC_GPU_LIMIT_${1^^}"
  run_part "$1" "${!override:-$2}" "$LOG" "$3"
}
# tests/gpu: about 40 cases of mpirun runs, in parallel shards (scripts/gpu_tests.sh,
# RANNC_GPU_SHARDS, default 4), then the profiler's cases alone. Each test's name as it
# runs (-v) and a per-test limit where pytest-timeout is there, so a part cut off by its own
# limit still says which tests passed and which one hung.
PER_TEST=""
python3 -c "import pytest_timeout" 2>/dev/null && PER_TEST="--timeout=150"
stamp="$(mktemp)"  # the results the parts write into bench/results go to $OUT
part bench 360 "python3 bench/runtime.py --device cuda --out '$OUT'"
part tests 420 "bash scripts/gpu_tests.sh"
part plans 240 "python3 bench/plan_time.py --device cuda --skip-whole"
# the plans-in-seconds issue's GPU cases: BERT-large's first step, its plan for 32 devices
part plans_large 300 "python3 bench/plan_time.py --device cuda --skip-whole --models bert_large --seq 128 --batch 16 --world 32 --device-memory 80GiB"
part models 300 "rc=0; for args in '' '--precision bf16' '--eval'; do python3 bench/hf_models.py --device cuda \$args || rc=1; done; exit \$rc"
part hf 240 "python3 -m pytest -v -rA $PER_TEST tests/python -k 'hf or transformers'"
part table 600 "python3 bench/profile_vs_stage.py --device cuda ${RANNC_GPU_TABLE_ARGS:-}"
find bench/results -maxdepth 1 \( -name 'profile_vs_stage_*' -o -name 'plan_time_cuda*' \) -newer "$stamp" \
  -exec cp {} "$OUT/" \;
rm -f "$stamp"

# the device tool brings back files of at most 16 MiB
for f in "$LOG" "$BUILD_LOG"; do
  if (($(stat -c %s "$f") > 15 * 1024 * 1024)); then
    tail -c $((15 * 1024 * 1024)) "$f" > "$f.tmp" && mv "$f.tmp" "$f"
  fi
done
note "total: $(($(date +%s) - START)) s; files: $(find "$OUT" -maxdepth 1 -type f -printf '%f\n' | sort | paste -sd ' ')"
echo
echo "===== $SUMMARY"
cat "$SUMMARY"
exit "$failed"
