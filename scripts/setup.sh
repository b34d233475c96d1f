#!/usr/bin/env bash
# Installs what refit needs (Debian packages) and builds it. Idempotent: packages already
# present are not reinstalled and the build is incremental.
# Usage: scripts/setup.sh [preset]     (preset: release (default), asan, tsan)
set -euo pipefail
cd "$(dirname "$0")/.."
preset="${1:-release}"

packages=(build-essential cmake ninja-build pkg-config libucx-dev ucx-utils libyaml-cpp-dev
          nlohmann-json3-dev libcli11-dev libspdlog-dev libfmt-dev libxxhash-dev libgtest-dev
          libgmock-dev libbenchmark-dev
          iproute2 procps python3)  # the simulated hosts of the tests (scripts/simhosts.sh)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  sudo_cmd=""
  [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "${missing[@]}"
fi

cmake --preset "$preset" >/dev/null
cmake --build --preset "$preset" -j "$(nproc)"
