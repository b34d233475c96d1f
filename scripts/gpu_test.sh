#!/usr/bin/env bash
# The whole test suite on a machine with a GPU: configures refit with the CUDA data path
# (REFIT_WITH_CUDA=ON), builds everything, runs the GPU tests (tests/gpu, ctest label "gpu"),
# then every other test (the CPU suite, which on a GPU machine also takes the GPU-aware paths:
# pinned host buffers, engine tests over the in-process transport), then the bandwidth ceiling
# probe. Needs no network: the dependencies must be installed already (scripts/setup.sh lists
# them; nvcc, libcudart, NCCL with its headers), or unpacked by scripts/device_deps.sh.
#
# Usage: scripts/gpu_test.sh [extra cmake args...]
#   e.g. scripts/gpu_test.sh -DREFIT_WITH_NCCL=ON
# Environment:
#   BUILD_DIR         build directory (default build/gpu)
#   JOBS              parallel build jobs (default: all cores)
#   TEST_JOBS         parallel CPU tests (default: half the cores, at most 8)
#   CMAKE_PREFIX_PATH, PKG_CONFIG_PATH   honoured as usual (e.g. UCX headers from an unpacked .deb)
#   CUDA_HOME         CUDA toolkit (default /usr/local/cuda when nvcc is not on PATH)
#   GPU_TEST_ALL=0    only the GPU layer's tests (tests/gpu and the CPU tests of the GPU layer),
#                     building only what they need; the default (1) runs the whole suite
#   CEILING_ARGS      arguments of refit_gpu_ceiling (default: 1 GiB copies, 10 each)
# Writes its log to $BUILD_DIR/gpu_test.log, ctest's JUnit reports to $BUILD_DIR/gpu_tests.xml and
# $BUILD_DIR/cpu_tests.xml, and the probe's JSON to $BUILD_DIR/gpu_ceiling.json.
# Exit status: non-zero when the build or any test fails.
set -euo pipefail
cd "$(dirname "$0")/.."
build="${BUILD_DIR:-build/gpu}"
jobs="${JOBS:-$(nproc)}"
test_jobs="${TEST_JOBS:-$(( $(nproc) / 2 > 8 ? 8 : ($(nproc) + 1) / 2 ))}"
all="${GPU_TEST_ALL:-1}"
mkdir -p "$build"
build_abs="$(cd "$build" && pwd)"
log="$build/gpu_test.log"
exec > >(tee "$log") 2>&1

if ! command -v nvcc >/dev/null 2>&1; then
  cuda_home="${CUDA_HOME:-/usr/local/cuda}"
  if [ -x "$cuda_home/bin/nvcc" ]; then
    export PATH="$cuda_home/bin:$PATH"
  else
    echo "gpu_test: nvcc not found on PATH nor in $cuda_home/bin; set CUDA_HOME" >&2
    exit 1
  fi
fi

echo "== machine"
uname -a
nvcc --version | tail -n 2
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=index,name,memory.total,driver_version,pci.bus_id --format=csv || true
  nvidia-smi topo -m || true
else
  echo "nvidia-smi not found"
fi
echo "CMAKE_PREFIX_PATH=${CMAKE_PREFIX_PATH:-}"
echo "PKG_CONFIG_PATH=${PKG_CONFIG_PATH:-}"
if command -v ucx_info >/dev/null 2>&1; then
  echo "UCX: $(ucx_info -v | head -n 1)"
  echo "UCX cuda transports: $(ucx_info -d 2>/dev/null | grep -c 'Transport: cuda' || true)"
fi

generator=()
if command -v ninja >/dev/null 2>&1; then generator=(-G Ninja); fi
# A build directory configured with another generator cannot be reused.
if [ -f "$build/CMakeCache.txt" ] && ! grep -q "CMAKE_GENERATOR:INTERNAL=${generator[1]:-Unix Makefiles}" "$build/CMakeCache.txt"; then
  echo "gpu_test: $build was configured with another generator; use another BUILD_DIR or remove it" >&2
  exit 1
fi

echo "== configure"
cmake -S . -B "$build" "${generator[@]}" \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DREFIT_WITH_CUDA=ON \
  -DREFIT_BUILD_BENCH=OFF \
  "$@"

echo "== build"
if [ "$all" = "1" ]; then
  cmake --build "$build" -j "$jobs"
else
  cmake --build "$build" -j "$jobs" --target refit_cli refit_gpu_tests refit_gpu_ceiling refit_transport_tests
fi

status=0
echo "== GPU tests (tests/gpu)"
# A GPU test fails, rather than skips, when no GPU is usable at all.
REFIT_REQUIRE_GPU=1 ctest --test-dir "$build" -L gpu --output-on-failure --timeout 600 \
  --output-junit "$build_abs/gpu_tests.xml" || status=1

if [ "$all" = "1" ]; then
  echo "== CPU tests (the rest of the suite, on a machine with a GPU)"
  ctest --test-dir "$build" -LE gpu --output-on-failure --timeout 600 -j "$test_jobs" \
    --output-junit "$build_abs/cpu_tests.xml" || status=1
else
  echo "== CPU tests of the GPU layer (device checks, registry, local control channel)"
  ctest --test-dir "$build" -R '^(LocalSocket|LocalSocketProcesses|LocalPeerAddress|LocalIdentity|InitParams|DeviceDetection|DeviceMemory|CopyStream|HostCopyPool|TransportRegistry)\.' \
    -LE gpu --output-on-failure --output-junit "$build_abs/cpu_tests.xml" || status=1
fi

echo "== bandwidth ceilings (refit_gpu_ceiling)"
# shellcheck disable=SC2086
"$build/tests/gpu/refit_gpu_ceiling" ${CEILING_ARGS:-} --json "$build/gpu_ceiling.json" || status=1

if [ "$status" -ne 0 ]; then
  echo "gpu_test: FAILED (see $log)"
else
  echo "gpu_test: all passed (log: $log, ceilings: $build/gpu_ceiling.json)"
fi
exit "$status"
