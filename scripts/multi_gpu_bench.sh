#!/usr/bin/env bash
# Issue 5's figures on a host with several GPUs: CUDA IPC refit over NVLink against the NCCL
# transport, side by side, for one model and bucket size, every refit checked bitwise.
#   1. ceilings: cudaMemcpyPeer and NCCL send/recv between GPU 1 and GPU 0 (refit_gpu_ceiling);
#   2. 1 source -> 1 destination (the local group puts the source on GPU 0, the destination on
#      GPU 1) over CUDA_IPC (mapped and staged) and over NCCL;
#   3. with 4 or more GPUs, N -> N paired refits at once (N = GPUs / 2: sources on GPUs 0..N-1,
#      destinations on N..2N-1), over CUDA_IPC and NCCL.
# NVLink multicast stays off (NCCL_NVLS_ENABLE=0). Build first (scripts/gpu_test.sh).
#
# Usage: scripts/multi_gpu_bench.sh [MODEL] [RUNS] [REFITS] [BUCKET]
#   defaults: data/models/qwen3-14b (27.5 GiB), 3 runs, 5 refits, 1GiB
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_common.sh
build="${BUILD_DIR:-build/gpu}"
model="${1:-data/models/qwen3-14b}"
runs="${2:-3}"
refits="${3:-5}"
bucket="${4:-1GiB}"
out="${GPU_BENCH_OUT:-$build/multi_gpu_bench}"
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0
gpus=$(nvidia-smi -L | wc -l)
if [ "$gpus" -lt 2 ]; then
  echo "multi_gpu_bench: needs at least 2 GPUs, this machine has $gpus" >&2
  exit 2
fi
bucket_bytes=$(size_bytes "$bucket")

echo "== ceilings between GPU 1 and GPU 0 (copies of $bucket)"
"$build/tests/gpu/refit_gpu_ceiling" --device 0 --bytes "$bucket_bytes" --iterations 10 --json "$out/ceiling.json"

run() {  # name pairs extra-args...
  local name="$1" pairs="$2"
  shift 2
  for r in $(seq 1 "$runs"); do
    echo "== $name, run $r"
    "$build/refit" bench --model "$model" --device cuda --sources "$pairs" --destinations "$pairs" --refits "$refits" \
      --json "$out/$name-$r.json" "refit_cfg.nixl.bucket_bytes=$bucket" "$@" 2>&1 | grep -v "vLLM refit"
  done
}
run ipc-1x1 1 refit_cfg.nixl.backend_name=CUDA_IPC
run ipc-staged-1x1 1 refit_cfg.nixl.backend_name=CUDA_IPC refit_cfg.nixl.map_source_buffers=false
run nccl-1x1 1 refit_cfg.nixl.backend_name=NCCL
names="ipc-1x1 ipc-staged-1x1 nccl-1x1"
if [ "$gpus" -ge 4 ]; then
  n=$((gpus / 2))
  run "ipc-${n}x${n}" "$n" refit_cfg.nixl.backend_name=CUDA_IPC
  run "nccl-${n}x${n}" "$n" refit_cfg.nixl.backend_name=NCCL
  names="$names ipc-${n}x${n} nccl-${n}x${n}"
fi

python3 - "$out" "$runs" "$names" <<'PY'
import json, statistics, sys
out, runs, names = sys.argv[1], int(sys.argv[2]), sys.argv[3].split()
c = json.load(open(f"{out}/ceiling.json"))
peer, nccl = c.get("peer_GBps"), c.get("nccl_p2p_GBps")
print(f"ceilings on {c['device']}: cudaMemcpyPeer {peer} GB/s, NCCL send/recv {nccl} GB/s")
per_pair = {}
for name in names:
    medians = []
    for r in range(1, runs + 1):
        j = json.load(open(f"{out}/{name}-{r}.json"))
        if not j["verified"]:
            print(f"{name} run {r}: NOT verified"); continue
        pairs = j["destinations"]
        medians.append(statistics.median(x["throughput_bytes_per_s"] for x in j["refits"]) / 1e9 / pairs)
    if not medians: continue
    m = statistics.median(medians)
    per_pair[name] = m
    ceiling = nccl if name.startswith("nccl") else peer
    ratio = f" = {m / ceiling:.3f} of {'NCCL send/recv' if name.startswith('nccl') else 'cudaMemcpyPeer'}" if ceiling else ""
    print(f"{name}: median {m:.1f} GB/s per pair{ratio} ({len(medians)} runs)")
for size in sorted({n.split("-")[-1] for n in per_pair}):
    ipc, nc = per_pair.get(f"ipc-{size}"), per_pair.get(f"nccl-{size}")
    if ipc and nc: print(f"{size}: CUDA IPC / NCCL = {ipc / nc:.2f}")
PY
