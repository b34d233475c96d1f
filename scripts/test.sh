#!/usr/bin/env bash
# The whole test suite: check the C++ formatting (.clang-format), set up, build, run every test (unit tests and multi-process tests over
# UCX), then the Python package's tests (pytest, with real Ray), then fuzz the decoders for a short budget, then run the suite again under
# AddressSanitizer + UndefinedBehaviorSanitizer and under ThreadSanitizer. This is what CI runs.
#
# Usage: scripts/test.sh                 everything, in that order (stops at the first failure)
#        scripts/test.sh format          only the formatting check (scripts/format.sh --check)
#        scripts/test.sh release|asan|tsan   one suite: the plain build (and the installed package,
#                                        built into tests/package), or one sanitizer build
#        scripts/test.sh python          only the Python package (pip install ., pytest)
#        scripts/test.sh fuzz [SECONDS]  only the fuzzers (scripts/fuzz.sh; default 20 s per target)
# REFIT_FUZZ_SECONDS sets the fuzz budget per target of the full run (default 20).
set -euo pipefail
cd "$(dirname "$0")/.."

suite() {
  local preset="$1" t0=$SECONDS
  echo "=== test suite: $preset"
  scripts/setup.sh "$preset"
  ctest --preset "$preset" -j 2
  echo "=== test suite $preset: $((SECONDS - t0)) s (build and tests)"
}

# The installed package, used by a project outside refit (tests/package) as another project would,
# and the README's C++ example built against it.
package() {
  local t0=$SECONDS prefix="$PWD/build/release/install"
  echo "=== package: install, then build and run tests/package against it"
  rm -rf "$prefix" build/package
  cmake --install build/release --prefix "$prefix" >/dev/null
  cmake -S tests/package -B build/package -G Ninja -DCMAKE_PREFIX_PATH="$prefix" >/dev/null
  cmake --build build/package
  build/package/refit_consumer
  # The README's C++ example: one refit between two processes, the destination then holds 1.5.
  local printed
  printed="$(build/package/readme_example)"
  echo "$printed"
  [[ "$printed" == *"destination holds w[-1] = 1.500000"* ]] || { echo "README example: unexpected output" >&2; exit 1; }
  echo "=== package: $((SECONDS - t0)) s"
}

what="${1:-all}"
case "$what" in
  all)
    start=$SECONDS
    scripts/format.sh --check
    suite release
    package
    echo "=== python package"
    t0=$SECONDS
    scripts/test_python.sh
    echo "=== python package: $((SECONDS - t0)) s (build and tests)"
    echo "=== fuzzers"
    t0=$SECONDS
    scripts/fuzz.sh "${REFIT_FUZZ_SECONDS:-20}"
    echo "=== fuzzers: $((SECONDS - t0)) s (build and runs)"
    suite asan
    suite tsan
    echo "=== all suites and fuzzers passed in $((SECONDS - start)) s"
    ;;
  release) suite release && package ;;
  asan | tsan) suite "$what" ;;
  fuzz) scripts/fuzz.sh "${2:-20}" ;;
  format) scripts/format.sh --check ;;
  python) scripts/test_python.sh ;;
  *)
    echo "usage: scripts/test.sh [format|release|asan|tsan|python|fuzz [SECONDS]]" >&2
    exit 2
    ;;
esac
