#!/usr/bin/env bash
# refit's Python package with NIXL on the lent GPU machine, which cannot download: builds the
# extension there (CUDA data path on), assembles an importable package under build/gpunixl/site,
# unpacks NIXL (a slimmed nixl-cu13 for Python 3.12: its UCX plugin and what it loads) and the
# test wheels carried in .device/nixl-slim (made here by scripts/nixl_slim.sh), then runs
# python/tests/test_nixl.py and python/bench/bench_nixl.py --device cuda.
#   eval "$(scripts/device_deps.sh)"; scripts/gpu_nixl.sh [bench arguments]
# Carry: .device/debs and .device/nixl-slim. Figures land in $OUT when it is set.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_common.sh
build="${BUILD_DIR:-build/gpunixl}"
site="$build/site"

echo "== build the extension"
python_site "$build"

echo "== NIXL and the test wheels"
tar -xJf .device/nixl-slim/nixl_cu13-slim.tar.xz -C "$site"
python3 -m pip install -q --no-index --no-deps --target "$site" .device/nixl-slim/wheels/*.whl
export PYTHONPATH="$PWD/$site${PYTHONPATH:+:$PYTHONPATH}"
# device_deps.sh points UCX_MODULE_DIR at the carried UCX 1.13's modules; NIXL's own UCX reads the
# same variable and would load those instead of its CUDA transports.
unset UCX_MODULE_DIR
python3 -c 'import refit, refit.nixl; print("refit", refit.__version__, "cuda_built", refit.cuda_built(), "NIXL:", refit.nixl.nixl_available() or "available")'

status=0
echo "== python/tests/test_nixl.py"
(cd python/tests && python3 -m pytest -q -p no:cacheprovider -rs test_nixl.py) || status=1
echo "== bench_nixl --device cuda"
python3 python/bench/bench_nixl.py --device cuda ${OUT:+--json "$OUT/bench_nixl_cuda.json"} "$@" || status=1
exit "$status"
