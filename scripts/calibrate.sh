#!/usr/bin/env bash
# Measures this machine for the cluster planner (refit plan --cluster ... --calibration FILE):
#   1. one source and one destination with buckets larger than the model, so every copy runs
#      alone: the engine's copy rate on one core, plus the baseline (memcpy on one core and on
#      all, ucx_perftest ucp_get at the bucket size and tag latency) and the driver's overhead;
#   2. the same with 16 MiB buckets, so a source packs while its destination loads: what the
#      host's memory gives two copies at once.
# Usage: scripts/calibrate.sh [FILE]   (default build/calibration.json; BUILD_DIR as elsewhere)
set -euo pipefail
cd "$(dirname "$0")/.."
FILE="${1:-build/calibration.json}"
REFIT="${BUILD_DIR:-build/release}/refit"
[ -x "$REFIT" ] || { echo "calibrate: build first (scripts/setup.sh release): $REFIT is missing" >&2; exit 1; }
rm -f "$FILE"
"$REFIT" bench --refits 5 --baseline --calibration-out "$FILE" | grep -E "^calibration|median"
"$REFIT" bench --refits 5 --calibration-out "$FILE" refit_cfg.nixl.bucket_bytes=16MiB | grep -E "^calibration|median"
