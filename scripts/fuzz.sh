#!/usr/bin/env bash
# Builds refit's libFuzzer targets (fuzz/) with clang 14 into build/fuzz and runs each one for a
# time budget, starting from the committed seed corpus (fuzz/corpus/<target>) plus seeds freshly
# generated from the current encoders. Installs what it needs (Debian packages) if missing.
#
# Usage: scripts/fuzz.sh [SECONDS] [TARGET...]   fuzz each target SECONDS (default 30) of wall time
#        scripts/fuzz.sh --seed                   rewrite the generated seeds in fuzz/corpus/
#        scripts/fuzz.sh --merge                  add inputs (<= 1 KiB) of build/fuzz/corpus/ that
#                                                 reach new coverage to fuzz/corpus/ (after a long run)
# Targets: metadata message layout assembler channel safetensors delta local_frame local_peer cuda_ipc_key
# nccl_request ucx_address (all by default, and in CI). The last five decode small blobs of a fixed
# layout and reach all their code within seconds: they run a quarter of SECONDS (at least 1 s).
# FUZZ_JOBS=N runs N targets at once (default: the number of cores). Exit status is non-zero if
# any target found a crash, a hang (an input running over 10 s), a leak or an out-of-memory; the
# input that did it is kept as build/fuzz/artifacts/<target>-crash-* (-timeout-, -oom-, -leak-)
# and the target's log as build/fuzz/logs/<target>.log.
# Reproduce one: build/fuzz/fuzz_<target> build/fuzz/artifacts/<target>-crash-...
set -euo pipefail
cd "$(dirname "$0")/.."

all_targets=(metadata message layout assembler channel safetensors delta local_frame local_peer cuda_ipc_key nccl_request
             ucx_address)
short_targets=" local_frame local_peer cuda_ipc_key nccl_request ucx_address "
mode=run
budget=30
case "${1:-}" in
  --seed) mode=seed; shift ;;
  --merge) mode=merge; shift ;;
  '' | *[!0-9]*) ;;
  *) budget="$1"; shift ;;
esac
targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=("${all_targets[@]}")

packages=(clang-14 libclang-rt-14-dev cmake ninja-build pkg-config libfmt-dev nlohmann-json3-dev libxxhash-dev)
scripts/install_packages.sh fuzz "${packages[@]}"

build=build/fuzz
if [ ! -f "$build/build.ninja" ]; then
  cmake -S fuzz -B "$build" -G Ninja -DCMAKE_C_COMPILER=clang-14 -DCMAKE_CXX_COMPILER=clang++-14 \
    -DCMAKE_BUILD_TYPE=Fuzz -DCMAKE_CXX_FLAGS_FUZZ="-O1 -g" >/dev/null
fi
cmake --build "$build" -j "$(nproc)" --target refit_fuzzers

# Seeds from the encoders of this checkout, so that a change of the wire format never leaves the
# fuzzers with only stale seeds.
rm -rf "$build/seeds"
"$build/fuzz_seed_corpus" "$build/seeds" >/dev/null

if [ "$mode" = seed ]; then
  # Overwrites the generated files; inputs added by hand (reproducers of fixed bugs) stay.
  "$build/fuzz_seed_corpus" fuzz/corpus
  exit 0
fi
if [ "$mode" = merge ]; then
  for t in "${targets[@]}"; do
    mkdir -p "$build/corpus/$t"
    # Inputs up to 1 KiB only, which keeps the committed corpus small.
    "$build/fuzz_$t" -merge=1 -max_len=1024 "fuzz/corpus/$t" "$build/corpus/$t" 2>&1 | grep "MERGE-OUTER: .* new files" || true
  done
  du -s --apparent-size -h fuzz/corpus
  exit 0
fi

mkdir -p "$build/logs" "$build/artifacts"
# The seconds target $1 runs.
target_budget() {
  if [[ "$short_targets" == *" $1 "* ]]; then
    echo $((budget / 4 > 0 ? budget / 4 : 1))
  else
    echo "$budget"
  fi
}

run_target() {
  local t="$1"
  mkdir -p "$build/corpus/$t"
  # The first corpus folder receives new inputs; the committed and generated seeds stay as they are.
  "$build/fuzz_$t" -max_total_time="$(target_budget "$t")" -timeout=10 -rss_limit_mb=2048 -use_value_profile=1 \
    -dict=fuzz/dict/protocol.dict -print_final_stats=1 -artifact_prefix="$build/artifacts/$t-" \
    "$build/corpus/$t" "fuzz/corpus/$t" "$build/seeds/$t" >"$build/logs/$t.log" 2>&1
}

jobs="${FUZZ_JOBS:-$(nproc)}"
echo "fuzz: ${targets[*]}, ${budget} s each ($((budget / 4 > 0 ? budget / 4 : 1)) s for${short_targets% }), ${jobs} at a time"
declare -A pids=()
failed=()
for t in "${targets[@]}"; do
  [ -x "$build/fuzz_$t" ] || { echo "fuzz: no target '$t' (targets: ${all_targets[*]})"; exit 2; }
  while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do sleep 1; done
  run_target "$t" &
  pids[$t]=$!
done
for t in "${targets[@]}"; do
  if ! wait "${pids[$t]}"; then failed+=("$t"); fi
  log="$build/logs/$t.log"
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  speed=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)
  cov=$(grep -o 'cov: [0-9]* ft: [0-9]* corp: [0-9]*' "$log" | tail -1 || true)
  echo "fuzz_$t: ${runs:-?} executions in $(target_budget "$t") s (${speed:-?}/s), ${cov:-no coverage line}"
done
if [ ${#failed[@]} -gt 0 ]; then
  for t in "${failed[@]}"; do
    echo "===== fuzz_$t FAILED: last lines of $build/logs/$t.log ====="
    tail -40 "$build/logs/$t.log"
  done
  echo "fuzz: ${#failed[@]} failed: ${failed[*]}"
  exit 1
fi
echo "fuzz: all ${#targets[@]} targets clean (no crash, hang, leak or out-of-memory)"
