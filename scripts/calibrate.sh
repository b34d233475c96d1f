#!/usr/bin/env bash
# Measures this machine for the cluster planner (refit plan --cluster ... --calibration FILE).
# CPU (default):
#   1. one source and one destination with buckets larger than the model, so every copy runs
#      alone: the engine's copy rate on one core, plus the baseline (memcpy on one core and on
#      all, ucx_perftest ucp_get at the bucket size and tag latency) and the driver's overhead;
#   2. the same with 16 MiB buckets, so a source packs while its destination loads: what the
#      host gives copies that overlap, and the engine's hand-off latency;
#   3. on hosts with fewer than 4 cores, two sources and two destinations: more copies at once
#      than cores;
#   steps 1-3 run the bucket path (refit_cfg.nixl.direct_reads=false); then the default path,
#   reads in place (direct_reads=true, the source's weights in UCX memory):
#   4. one source and one destination, groups larger than the model: the in-place load rate;
#   5. the same with 16 MiB groups: each group's cost beyond its bytes, the turnaround and the
#      hand-offs' latencies;
#   6. on hosts with fewer than 4 cores, two sources and two destinations in place: the loads'
#      rate together while their sources wait beside them (more processes than cores);
#   7. a delta refit (refit_cfg.nixl.delta=true) of 1% of the elements: the source's comparing and
#      the destination's patching, whose cost per changed element the planner solves for.
# GPU (--gpu, on the GPU machine): the copy ceilings of GPU 0 (refit_gpu_ceiling: device copy,
#   pinned host copy, peer copy and NCCL with a second GPU), then steps 1, 2, 4, 5 and 7 with GPU
#   tensors and buffers on GPU 0 (MODEL, default data/models/qwen3-8b; CUDA IPC, so step 4 and 5
#   read the source's GPU tensors in place; step 7 compares and patches with the GPU's kernels).
# Each is run ROUNDS times (default 3) into files of their own, and FILE gets the median of each
# value over the rounds: this kind of machine varies by 10-15% from one minute to the next.
# Usage: scripts/calibrate.sh [--gpu] [FILE]   (default build/calibration.json; BUILD_DIR as elsewhere)
set -euo pipefail
cd "$(dirname "$0")/.."
gpu=0
if [ "${1:-}" = "--gpu" ]; then gpu=1; shift; fi
BUILD="${BUILD_DIR:-build/release}"
FILE="${1:-$BUILD/calibration.json}"
REFIT="$BUILD/refit"
[ -x "$REFIT" ] || { echo "calibrate: build first (scripts/setup.sh release): $REFIT is missing" >&2; exit 1; }
rounds="${ROUNDS:-3}"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
one_round() {  # $1: the file of this round
  local out="$1"
  if [ "$gpu" = 1 ]; then
    local model="${MODEL:-data/models/qwen3-8b}"
    "$BUILD/tests/gpu/refit_gpu_ceiling" --device 0 --bytes $((1 << 30)) --iterations 10 --calibration-out "$out" | tail -n 1
    local reads bucket
    for reads in false true; do  # the bucket path, then reads in place (the in-place rate needs the first)
      for bucket in 20GiB 256MiB; do
        CUDA_VISIBLE_DEVICES=0 "$REFIT" bench --model "$model" --device cuda --tensors cuda --refits 5 \
          --calibration-out "$out" refit_cfg.nixl.bucket_bytes=$bucket refit_cfg.nixl.direct_reads=$reads |
          grep -E "^calibration"
      done
    done
    CUDA_VISIBLE_DEVICES=0 "$REFIT" bench --model "$model" --device cuda --tensors cuda --refits 5 --changed 0.01 \
      --calibration-out "$out" refit_cfg.nixl.bucket_bytes=256MiB refit_cfg.nixl.delta=true | grep -E "^calibration"
    return
  fi
  local buckets=refit_cfg.nixl.direct_reads=false
  "$REFIT" bench --refits 5 --baseline --calibration-out "$out" $buckets | grep -E "^calibration"
  "$REFIT" bench --refits 5 --calibration-out "$out" refit_cfg.nixl.bucket_bytes=16MiB $buckets | grep -E "^calibration"
  if [ "$(nproc)" -lt 4 ]; then
    "$REFIT" bench --refits 5 --sources 2 --destinations 2 --calibration-out "$out" refit_cfg.nixl.bucket_bytes=16MiB \
      $buckets | grep -E "^calibration"
  fi
  # Reads in place: the rate first (one group), then what each of many groups costs at that rate.
  "$REFIT" bench --refits 5 --calibration-out "$out" refit_cfg.nixl.direct_reads=true | grep -E "^calibration"
  "$REFIT" bench --refits 5 --calibration-out "$out" refit_cfg.nixl.bucket_bytes=16MiB refit_cfg.nixl.direct_reads=true |
    grep -E "^calibration"
  if [ "$(nproc)" -lt 4 ]; then
    "$REFIT" bench --refits 5 --sources 2 --destinations 2 --calibration-out "$out" refit_cfg.nixl.bucket_bytes=16MiB \
      refit_cfg.nixl.direct_reads=true | grep -E "^calibration"
  fi
  "$REFIT" bench --refits 5 --changed 0.01 --calibration-out "$out" refit_cfg.nixl.delta=true | grep -E "^calibration"
}
for ((r = 1; r <= rounds; r++)); do
  echo "== calibration round $r of $rounds"
  one_round "$work/round$r.json"
done
python3 - "$FILE" "$work"/round*.json <<'PY'
import json, statistics, sys
out, rounds = sys.argv[1], [json.load(open(p)) for p in sys.argv[2:]]
merged = dict(rounds[-1])
for key in merged:
    values = [r[key] for r in rounds if isinstance(r.get(key), (int, float))]
    if values and all(isinstance(v, (int, float)) for v in values):
        merged[key] = statistics.median(values)
merged["machine"] = f"{merged.get('machine', '')}; median of {len(rounds)} rounds"
json.dump(merged, open(out, "w"), indent=2)
print(f"calibration {out}: median of {len(rounds)} rounds")
PY
