#!/usr/bin/env bash
# The GPU refit figures of docs/GPU.md, on a machine with a GPU: the copy ceilings of this GPU
# (refit_gpu_ceiling), then `refit bench` between one source and one destination process with
# GPU-resident tensors, RUNS times per transfer-buffer device, each run REFITS refits checked
# bitwise; prints each run's median and the median over runs as a ratio to its ceiling:
#   device cuda (CUDA IPC)              against the device-to-device copy;
#   device cpu  (UCX, pinned host buffers) against the slower pinned copy direction.
# By default a destination loads tensors straight from the source's own GPU memory where it can
# map it (direct_reads with CUDA IPC: one copy per byte). A device's modifiers, joined by "+":
#   buckets  direct_reads=false: every tensor is packed into a bucket that the destination loads
#            from the source's mapped buffer (two copies);
#   staged   map_source_buffers=false as well: the destination reads every bucket into its own
#            buffer before loading it (three copies);
#   ucx      backend_name=UCX with GPU buffers (CUDA-aware UCX; the default for device cuda is
#            CUDA_IPC);
#   changed  the delta workload (`--changed 0.01`: 1% of every tensor's elements move by a unit in
#            the last place after each refit) sent whole;
#   delta    the same as delta refits (only the changes travel; the first refit goes whole);
#   auto     the same with delta: auto (refit's choice: off where the link maps memory on one host).
# e.g. DEVICES "cuda cuda+ucx cuda+ucx+staged cpu+changed cpu+delta cuda+changed cuda+delta".
# The summary gives each device's median against its ceiling and against the best device of its
# memory kind in the run (GPU buffers, pinned host buffers; the delta workload apart), marking a
# device under half of that best.
# Build first (scripts/gpu_test.sh builds $BUILD_DIR).
#
# Usage: scripts/gpu_bench.sh [MODEL] [RUNS] [REFITS] [BUCKET] [DEVICES]
#   defaults: data/models/qwen3-14b (27.5 GiB), 3 runs, 5 refits, BUCKET "default" (the engine's
#   own sizing: update_weights_bucket_memory_ratio of the smallest worker's device memory),
#   "cuda cuda+buckets cuda+staged cpu cpu+staged"
# Writes JSON to $GPU_BENCH_OUT (default $BUILD_DIR/gpu_bench/).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_common.sh
build="${BUILD_DIR:-build/gpu}"
model="${1:-data/models/qwen3-14b}"
runs="${2:-3}"
refits="${3:-5}"
bucket="${4:-default}"
devices="${5:-cuda cuda+buckets cuda+staged cpu cpu+staged}"
out="${GPU_BENCH_OUT:-$build/gpu_bench}"
mkdir -p "$out"
bucket_override=()
ceiling_bytes=$((1 << 30))
if [ "$bucket" != "default" ]; then
  bucket_override=("refit_cfg.nixl.bucket_bytes=$bucket")
  ceiling_bytes=$(size_bytes "$bucket")
fi

echo "== ceilings (copies of $ceiling_bytes bytes)"
"$build/tests/gpu/refit_gpu_ceiling" --bytes "$ceiling_bytes" --iterations 10 --json "$out/ceiling.json"

for device in $devices; do
  for run in $(seq 1 "$runs"); do
    echo "== device $device, run $run"
    map=true direct=true extra=()
    for modifier in $(tr '+' ' ' <<<"${device#"${device%%+*}"}"); do
      case "$modifier" in
        staged) map=false direct=false ;;
        buckets) direct=false ;;
        ucx) extra+=(refit_cfg.nixl.backend_name=UCX) ;;
        changed) extra+=(--changed 0.01) ;;
        delta) extra+=(--changed 0.01 refit_cfg.nixl.delta=true) ;;
        auto) extra+=(--changed 0.01 refit_cfg.nixl.delta=auto) ;;
        *) echo "gpu_bench: unknown modifier $modifier in $device" >&2; exit 2 ;;
      esac
    done
    "$build/refit" bench --model "$model" --device "${device%%+*}" --tensors cuda --refits "$refits" \
      --json "$out/$device-$run.json" "${bucket_override[@]}" "${extra[@]}" \
      "refit_cfg.nixl.map_source_buffers=$map" "refit_cfg.nixl.direct_reads=$direct" 2>&1 | grep -v "vLLM refit"
  done
done

python3 - "$out" "$runs" "$devices" "$refits" <<'PY'
import json, statistics, sys
out, runs, devices, refits = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(), int(sys.argv[4])
ceiling = json.load(open(f"{out}/ceiling.json"))
ceilings = {"cuda": ("device-to-device copy", ceiling["d2d_GBps"]),
            "cpu": ("pinned host copy (slower direction)", min(ceiling["h2d_pinned_GBps"], ceiling["d2h_pinned_GBps"]))}
print(f"ceilings on {ceiling['device']}: d2d {ceiling['d2d_GBps']:.1f} GB/s, pinned h2d {ceiling['h2d_pinned_GBps']:.1f}"
      f" / d2h {ceiling['d2h_pinned_GBps']:.1f} GB/s")
summary = {}
for device in devices:
    medians, seconds, wire, scans, patches = [], [], [], [], []
    for run in range(1, runs + 1):
        r = json.load(open(f"{out}/{device}-{run}.json"))
        if not r["verified"]:
            print(f"device {device} run {run}: NOT verified"); continue
        rates = [x["throughput_bytes_per_s"] / 1e9 for x in r["refits"]]
        medians.append(statistics.median(rates))
        # Refits after the first (the first sends every byte, also with delta).
        later = r["refits"][1:] or r["refits"]
        seconds.append(statistics.median(x["seconds"] for x in later))
        wire.append(statistics.median(x["bytes_received"][0].get("wire_bytes", x["bytes_received"][0]["bytes"]) for x in later))
        # Delta: the source's comparing and the destination's patching, within each refit.
        scans.append(statistics.median(max(s.get("delta_seconds", 0) for s in x["bytes_sent"]) for x in later))
        patches.append(statistics.median(max(d.get("delta_seconds", 0) for d in x["bytes_received"]) for x in later))
        last = r["refits"][-1]["bytes_received"][0]
        print(f"device {device} run {run}: {r['model_bytes']/2**30:.2f} GiB, {r['bucket_bytes']/2**20:.0f} MiB buckets, "
              f"refits GB/s " + " ".join(f"{x:.1f}" for x in rates) + f", median {medians[-1]:.1f} "
              f"(last refit: destination receive {last['receive_seconds']*1e3:.1f} ms, load {last['load_seconds']*1e3:.1f} ms, "
              f"{last.get('in_place_bytes', 0) / max(last['bytes'], 1):.0%} of the bytes in place)")
    if medians:
        name, c = ceilings[device.split("+")[0]]
        m = statistics.median(medians)
        summary[device] = m
        print(f"device {device}: median {m:.1f} GB/s = {m / c:.3f} of the {name} ({c:.1f} GB/s), {len(medians)} runs; "
              f"refits 2-{refits}: {statistics.median(seconds) * 1e3:.1f} ms, {statistics.median(wire) / 2**20:.2f} MiB on the wire"
              + (f" (comparing {statistics.median(scans) * 1e3:.1f} ms at the source, patching "
                 f"{statistics.median(patches) * 1e3:.1f} ms at the destination)" if statistics.median(scans) > 0 else ""))
        if device.startswith("cpu") and "duplex_pinned_GBps" in ceiling:
            # Pinned host buffers move every byte over PCIe twice, one way each, at the same time.
            d = ceiling["duplex_pinned_GBps"]
            print(f"device {device}: = {m / d:.3f} of the pinned copy both ways at once ({d:.1f} GB/s each way)")
# Each full-refit device against the best of its memory kind (the transfer buffers' memory).
for kind, label in (("cuda", "GPU buffers"), ("cpu", "pinned host buffers")):
    rows = {d: m for d, m in summary.items() if d.split("+")[0] == kind and not {"changed", "delta", "auto"} & set(d.split("+"))}
    if len(rows) < 2:
        continue
    best = max(rows, key=rows.get)
    for d, m in rows.items():
        mark = "" if m >= 0.5 * rows[best] else "  UNDER HALF"
        print(f"{label}: {d} {m:.1f} GB/s = {m / rows[best]:.3f} of the best ({best}){mark}")
PY
