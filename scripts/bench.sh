#!/usr/bin/env bash
# The main job: set up, build, and run `refit bench` on the embedded default model between local
# processes. Extra arguments go to `refit bench` (e.g. --sources 2 --destinations 2 --baseline).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh release
exec build/release/refit bench "$@"
