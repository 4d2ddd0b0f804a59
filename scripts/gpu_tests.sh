#!/usr/bin/env bash
# tests/gpu on the lent GPU machine (the `tests` part of scripts/gpu_session.sh), in as
# little of the session's 15 minutes as it can: the cases of test_cuda_module.py (each an
# mpirun of 1-4 ranks on small models: correctness, not speed) in RANNC_GPU_SHARDS pytest
# processes at once (default 4; the machine has 16 cores and the models need little of the
# GPU), then test_cuda_profile.py alone, whose timings and memory peaks want the GPU to
# themselves. Each shard's lines go to stdout as they come, prefixed "[shard N]", so a
# part cut off by its limit still shows what passed. Exits non-zero when any case failed.
#   bash scripts/gpu_tests.sh [pytest args...]      (e.g. -k "trainer" to run some)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
shards="${RANNC_GPU_SHARDS:-4}"
args=(-v -rA --durations=5 "$@")
python3 -c "import pytest_timeout" 2>/dev/null && args+=(--timeout=150)
mapfile -t ids < <(python3 -m pytest --collect-only -q "$@" tests/gpu/test_cuda_module.py 2>/dev/null \
  | grep '::')
echo "tests/gpu: ${#ids[@]} cases of test_cuda_module.py in $shards shards, then test_cuda_profile.py"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
for ((s = 0; s < shards; s++)); do
  mine=()
  for ((i = s; i < ${#ids[@]}; i += shards)); do mine+=("${ids[i]}"); done
  ((${#mine[@]})) || continue
  (
    python3 -m pytest "${args[@]}" "${mine[@]}" 2>&1
    echo $? > "$tmp/rc$s"
  ) | sed -u "s/^/[shard $s] /" &
done
wait
rc=0
for ((s = 0; s < shards && s < ${#ids[@]}; s++)); do
  code="$(cat "$tmp/rc$s" 2>/dev/null || echo missing)"
  echo "shard $s: exit $code"
  [[ "$code" == 0 ]] || rc=1
done
python3 -m pytest "${args[@]}" tests/gpu/test_cuda_profile.py || rc=1
exit "$rc"
