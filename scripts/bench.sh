#!/usr/bin/env bash
# The main job: set up, build, and run `refit bench` on the embedded default model between local
# processes. Extra arguments go to `refit bench` (e.g. --sources 2 --destinations 2 --baseline).
# Builds the `refit` program alone (its workers are forks of it; --baseline runs ucx_perftest, from
# ucx-utils), not the tests: scripts/test.sh builds those.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh release refit_cli
exec build/release/refit bench "$@"
