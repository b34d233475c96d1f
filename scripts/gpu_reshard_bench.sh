#!/usr/bin/env bash
# Resharding with GPU tensors on the lent GPU machine (the figures of docs/GPU.md, Resharding):
# every process shares the GPU(s); sources hold only their shards in GPU memory, destinations
# their slices in GPU memory, and each destination checks every byte it keeps on the GPU. First
# the copy ceilings of this GPU (refit_gpu_ceiling), then, RUNS times each:
#   8 -> 4  Megatron TP2 x EP4 (DP4) sources -> TP4 destinations, with the paired path (a gather
#           into one full copy per destination, then the paired refit) timed in the same run;
#   2 -> 6  TP2 sources -> TP2 x PP3 destinations;
#   fp8     the 8 -> 4 job on the model's FP8 form (--fp8), destinations TP2 x EP2 (TP4 would cut
#           the experts' 768 rows inside 128-row scale blocks).
# The model is Qwen3-30B-A3B's shape with LAYERS decoder layers (all 48: 61 GB in bf16; the
# default 12: 15.6 GB) so that every process of a job fits on one GPU.
# Build first (scripts/gpu_test.sh builds $BUILD_DIR).
#
# Usage: scripts/gpu_reshard_bench.sh [RUNS] [REFITS] [LAYERS] [JOBS]
#   defaults: 3 runs, 3 refits, 12 layers, jobs "8to4 2to6 fp8"
# Environment: BUILD_DIR (default build/gpu), BUCKET (default 512MiB), DEVICE (default cuda:
#   CUDA IPC; cpu: UCX with pinned host buffers). JSON goes to $GPU_BENCH_OUT (default
#   $BUILD_DIR/gpu_reshard).
set -euo pipefail
cd "$(dirname "$0")/.."
build="${BUILD_DIR:-build/gpu}"
runs="${1:-3}"
refits="${2:-3}"
layers="${3:-12}"
jobs="${4:-8to4 2to6 fp8}"
bucket="${BUCKET:-512MiB}"
device="${DEVICE:-cuda}"
out="${GPU_BENCH_OUT:-$build/gpu_reshard}"
mkdir -p "$out"

model="$out/qwen3-30b-a3b-${layers}l"
mkdir -p "$model"
python3 - data/models/qwen3-30b-a3b/config.json "$model/config.json" "$layers" <<'PY'
import json, sys
config = json.load(open(sys.argv[1]))
config["num_hidden_layers"] = int(sys.argv[3])
config["max_window_layers"] = int(sys.argv[3])
json.dump(config, open(sys.argv[2], "w"), indent=1)
PY

echo "== ceilings"
"$build/tests/gpu/refit_gpu_ceiling" --bytes $((1 << 30)) --iterations 10 --json "$out/ceiling.json"

common=(--model "$model" --device "$device" --tensors cuda --refits "$refits" "refit_cfg.nixl.bucket_bytes=$bucket")
for job in $jobs; do
  case "$job" in
    8to4) args=(--sources 8 --src-tp 2 --src-ep 4 --src-etp 1 --destinations 4 --tp 4 --shard-dense
                refit_cfg.nixl.shard_expert_weights=true --compare-paired) ;;
    2to6) args=(--sources 2 --src-tp 2 --destinations 6 --tp 2 --pp 3 --shard-dense
                refit_cfg.nixl.shard_expert_weights=true) ;;
    fp8) args=(--fp8 --sources 8 --src-tp 2 --src-ep 4 --src-etp 1 --destinations 4 --tp 2 --ep 2 --shard-dense
               refit_cfg.nixl.shard_expert_weights=true) ;;
    *) echo "unknown job $job" >&2; exit 2 ;;
  esac
  for run in $(seq 1 "$runs"); do
    echo "== $job, run $run"
    "$build/refit" bench "${common[@]}" "${args[@]}" --json "$out/$job-$run.json" 2>&1 | grep -v "vLLM refit"
  done
done

python3 - "$out" "$runs" "$jobs" <<'PY'
import json, statistics, sys
out, runs, jobs = sys.argv[1], int(sys.argv[2]), sys.argv[3].split()
d2d = json.load(open(f"{out}/ceiling.json"))["d2d_GBps"]
print(f"device-to-device copy ceiling: {d2d:.1f} GB/s")
for job in jobs:
    results = [json.load(open(f"{out}/{job}-{r}.json")) for r in range(1, runs + 1)]
    rates, seconds = [], []
    for r in results:
        ok = [x for x in r["refits"] if x.get("ok")]
        # Every byte any destination received, per second of the refit: the aggregate rate.
        rates.append(statistics.median(sum(d["bytes"] for d in x["bytes_received"]) / x["seconds"] / 1e9 for x in ok))
        seconds.append(statistics.median(x["seconds"] for x in ok))
    verified = all(r["verified"] for r in results)
    line = (f"{job}: refit {statistics.median(seconds):.3f} s, aggregate {statistics.median(rates):.1f} GB/s "
            f"= {statistics.median(rates) / d2d:.3f} of d2d (runs: {', '.join(f'{x:.1f}' for x in rates)}); "
            f"verified: {'yes' if verified else 'NO'}")
    paired = [r["compare_paired"] for r in results if "compare_paired" in r]
    if paired:
        total = statistics.median(p["paired_total_seconds"] for p in paired)
        line += f"; paired path (gather + refit) {total:.3f} s = {total / statistics.median(seconds):.2f}x"
    print(line)
PY
