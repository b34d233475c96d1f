#!/usr/bin/env bash
# The whole test suite: set up, build, run every test (unit tests and multi-process tests over
# UCX). Pass a preset (asan, tsan) to run it under a sanitizer instead.
set -euo pipefail
cd "$(dirname "$0")/.."
preset="${1:-release}"
scripts/setup.sh "$preset"
ctest --preset "$preset" -j 2
