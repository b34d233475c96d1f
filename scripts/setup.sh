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

# Runs a step with one line saying what it does; its output (apt-get and dpkg print hundreds of
# lines) is shown only when it fails.
step() {
  local what="$1" log
  shift
  echo "setup: $what"
  log="$(mktemp)"
  if ! "$@" >"$log" 2>&1; then
    cat "$log" >&2
    rm -f "$log"
    echo "setup: that step failed (its output is above)" >&2
    exit 1
  fi
  rm -f "$log"
}

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  sudo_cmd=()
  [ "$(id -u)" -ne 0 ] && sudo_cmd=(sudo)
  step "updating the package lists (apt-get update)" "${sudo_cmd[@]}" apt-get update -qq
  step "installing ${missing[*]}" \
    "${sudo_cmd[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
fi

cmake --preset "$preset" >/dev/null
target_args=()
if [ ${#targets[@]} -gt 0 ]; then target_args=(--target "${targets[@]}"); fi
cmake --build --preset "$preset" -j "$(nproc)" "${target_args[@]}"
