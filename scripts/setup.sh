#!/usr/bin/env bash
# Installs what refit needs (Debian packages) and builds it. Idempotent: packages already
# present are not reinstalled and the build is incremental.
# Usage: scripts/setup.sh [preset [target...]]   (preset: release (default), asan, tsan; targets: what to
#                                                build, e.g. refit_cli for the `refit` program; default: everything)
set -euo pipefail
cd "$(dirname "$0")/.."
preset="${1:-release}"
targets=("${@:2}")

packages=(build-essential cmake ninja-build pkg-config libucx-dev ucx-utils libyaml-cpp-dev
          nlohmann-json3-dev libcli11-dev libspdlog-dev libfmt-dev libxxhash-dev libgtest-dev
          libgmock-dev libbenchmark-dev
          iproute2 procps python3)  # the simulated hosts of the tests (scripts/simhosts.sh)

scripts/install_packages.sh setup "${packages[@]}"

cmake --preset "$preset" >/dev/null
target_args=()
if [ ${#targets[@]} -gt 0 ]; then target_args=(--target "${targets[@]}"); fi
cmake --build --preset "$preset" -j "$(nproc)" "${target_args[@]}"
