#!/usr/bin/env bash
# Refit across simulated hosts with shaped links, against the links' own limit. SOURCES +
# DESTINATIONS hosts (scripts/simhosts.sh), each link shaped to RATE both ways; sources on the
# first hosts feed destinations on the rest (`refit bench --launcher env`, one rank per host). For
# each model and bucket size it prints the median refit time against:
#   - the link bound: the most bytes any host's link carries (a destination's ingress, or a
#     source's egress when resharding) / RATE (what the links allow at best);
#   - ucx_perftest ucp_get between two of the same hosts, at the bucket size (the ceiling measured
#     in the same run, on the same shaped links).
# A benchmark, not a test: it prints ratios and never fails on them.
#
# Usage: scripts/hosts_bench.sh [RATE] [REFITS]     (default 2gbit, 3 refits; needs root)
# Environment: BUILD_DIR (default build/release), MODELS (default: small builtin 2g),
#              BUCKETS (default "16MiB 64MiB"), SOURCES and DESTINATIONS (default 2 and 2),
#              BENCH_ARGS (more `refit bench` arguments, e.g. resharding:
#              "--src-tp 2 --src-dp 2 --tp 2 --shard-dense" with SOURCES=4), KEEP_JSON (copy the
#              last bench's --json here; scripts/check_planner.py uses it), DELTA (a changed share,
#              e.g. 0.017: each model and bucket runs twice on the same hosts, a full refit and a
#              delta refit (refit_cfg.nixl.delta=true) and one with delta=auto of the workload
#              `refit bench --changed DELTA`, timed over the refits after the first, which a delta
#              refit sends whole).
set -euo pipefail
cd "$(dirname "$0")/.."
RATE="${1:-2gbit}"
REFITS="${2:-3}"
BUILD_DIR="${BUILD_DIR:-build/release}"
MODELS="${MODELS:-small builtin 2g}"
BUCKETS="${BUCKETS:-16MiB 64MiB}"
SOURCES="${SOURCES:-2}"
DESTINATIONS="${DESTINATIONS:-2}"
BENCH_ARGS="${BENCH_ARGS:-}"
WORLD=$((SOURCES + DESTINATIONS))
REFIT="$PWD/$BUILD_DIR/refit"
[ -x "$REFIT" ] || { echo "hosts_bench: build first (scripts/setup.sh release): $REFIT is missing" >&2; exit 1; }
scripts/simhosts.sh check >/dev/null || { scripts/simhosts.sh check; exit 1; }

if [ -z "${SIMHOSTS_TAG:-}" ]; then
  exec scripts/simhosts.sh with "$WORLD" --rate "$RATE" -- "$0" "$@"
fi

work="$PWD/$BUILD_DIR/hosts-bench"
rm -rf "$work" && mkdir -p "$work"
# A 26 MiB MoE, for the small end.
cat >"$work/small.json" <<'EOF'
{"model_type": "qwen3_moe", "torch_dtype": "bfloat16", "hidden_size": 256, "intermediate_size": 512,
 "moe_intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
 "head_dim": 64, "vocab_size": 16000, "num_experts": 16, "num_experts_per_tok": 2, "decoder_sparse_step": 1,
 "mlp_only_layers": [], "rms_norm_eps": 1e-6, "tie_word_embeddings": false}
EOF
model_path() {
  case "$1" in
    small) echo "$work/small.json" ;;
    builtin) echo "builtin:refit-tiny-moe" ;;
    2g) echo "$PWD/data/models/refit-bench-2g" ;;
    *) echo "$1" ;;
  esac
}
H() { scripts/simhosts.sh "$1" "$SIMHOSTS_TAG" "${@:2}"; }
master=$(H addr 1)
bits=$(python3 -c '
import re, sys
m = re.fullmatch(r"([0-9.]+)([kmg]?)bit", sys.argv[1].lower())
print(int(float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]))' "$RATE")

# The ceiling: ucp_get between host 1 (a source) and the first destination's host over the shaped
# links, at a bucket size.
ceiling() {
  local bytes="$1" port=$((13000 + RANDOM % 1000))
  H exec 1 timeout 60 ucx_perftest -p "$port" >/dev/null 2>&1 &
  local server=$!
  sleep 1
  local line
  line=$(H exec $((SOURCES + 1)) timeout 60 ucx_perftest "$master" -p "$port" -t ucp_get -s "$bytes" -n 8 -w 2 2>/dev/null | grep Final || true)
  wait "$server" 2>/dev/null || true
  # Final: iterations, latency typ/avg/overall, bandwidth avg (MB/s), overall (MB/s), ...
  echo "$line" | awk '{print $7 * 1048576}'
}

MODES=plain
[ -z "${DELTA:-}" ] || MODES="full delta auto"
printf '%-8s %-7s %-5s %12s %10s %10s %9s %12s %9s\n' model bucket mode "MiB/dest" "bound s" "refit s" "x bound" \
  "ucp_get MB/s" "x ucp_get"
for model in $MODELS; do
  for bucket in $BUCKETS; do
   for mode in $MODES; do
    port=$((29000 + RANDOM % 1000))
    json="$work/$model-$bucket-$mode.json"
    MODE_ARGS=""
    [ "$mode" = plain ] || MODE_ARGS="--changed $DELTA"
    [ "$mode" != delta ] || MODE_ARGS="$MODE_ARGS refit_cfg.nixl.delta=true"
    [ "$mode" != auto ] || MODE_ARGS="$MODE_ARGS refit_cfg.nixl.delta=auto"
    pids=()
    for ((r = 1; r < WORLD; r++)); do
      # shellcheck disable=SC2086  # BENCH_ARGS is a list of arguments
      H exec $((r + 1)) env RANK=$r WORLD_SIZE=$WORLD MASTER_ADDR="$master" MASTER_PORT="$port" "$REFIT" bench \
        --launcher env --model "$(model_path "$model")" --sources "$SOURCES" --destinations "$DESTINATIONS" \
        --refits "$REFITS" $BENCH_ARGS $MODE_ARGS "refit_cfg.nixl.bucket_bytes=$bucket" >"$work/$model-$bucket.rank$r.log" 2>&1 &
      pids+=($!)
    done
    # shellcheck disable=SC2086
    H exec 1 env RANK=0 WORLD_SIZE=$WORLD MASTER_ADDR="$master" MASTER_PORT="$port" "$REFIT" bench --launcher env \
      --model "$(model_path "$model")" --sources "$SOURCES" --destinations "$DESTINATIONS" --refits "$REFITS" \
      --json "$json" $BENCH_ARGS $MODE_ARGS "refit_cfg.nixl.bucket_bytes=$bucket" >"$work/$model-$bucket.rank0.log" 2>&1 || {
      echo "hosts_bench: $model $bucket failed:"; tail -n 20 "$work/$model-$bucket.rank0.log"; exit 1; }
    wait "${pids[@]}" || true
    [ -z "${KEEP_JSON:-}" ] || cp "$json" "$KEEP_JSON"
    bucket_bytes=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["bucket_bytes"])' "$json")
    get=$(ceiling "$bucket_bytes")
    python3 - "$json" "$bits" "$model" "$bucket" "${get:-0}" "$mode" <<'EOF'
import json, statistics, sys
result, bits, model, bucket, get = json.load(open(sys.argv[1])), float(sys.argv[2]), sys.argv[3], sys.argv[4], float(sys.argv[5])
mode = sys.argv[6]
assert result["verified"], "not verified"
refits = result["refits"]
if mode != "plain":
    # The first refit of a delta run has no base and goes whole: both modes are timed without it.
    assert len(refits) > 1, "DELTA needs at least 2 refits"
    refits = refits[1:]
per_dest = max(d["bytes"] for r in refits for d in r["bytes_received"])
wire = max(d["wire_bytes"] for r in refits for d in r["bytes_received"])
# Resharding: a source's link may carry more than any destination's.
egress = max((s["bytes"] for r in refits for s in r.get("bytes_sent", []) if result.get("resharding")),
             default=0)
routes = sorted({d["route"] for r in refits for d in r["bytes_received"]})
seconds = statistics.median(r["seconds"] for r in refits)
# A delta refit's bound is what it puts on the wire; a full one's, the model.
bound = (wire if mode in ("delta", "auto") else max(per_dest, egress)) / (bits / 8)
line = f"{model:<8} {bucket:<7} {mode:<5} {per_dest / 2**20:12.1f} {bound:10.3f} {seconds:10.3f} {seconds / bound:9.3f}"
if get > 0:
    line += f" {get / 1e6:12.1f} {(per_dest / seconds) / get:9.3f}"
if mode in ("delta", "auto"):
    line += f"   (wire {wire / 2**20:.2f} MiB)"
print(line + f"   ({', '.join(routes)})")
EOF
   done
  done
done
echo "rate $RATE per host link (tbf, both directions); refit s: median of $REFITS refits, every one verified bitwise;"
echo "x bound = refit time / (most bytes on one host's link / rate); x ucp_get = refit throughput per destination / ucp_get"
[ -z "${DELTA:-}" ] || echo "full / delta / auto: the workload --changed $DELTA with refit_cfg.nixl.delta false, true and auto, timed over refits 2..$REFITS; a delta refit's bound is its wire bytes / rate (auto: the wire of its refit that sent most)"
