#!/usr/bin/env bash
# Installs the Debian packages named that are missing (none: does nothing), as root or through
# sudo, saying in one line what it installs; apt-get's and dpkg's output (hundreds of lines) is
# shown only when the install fails. Usage: scripts/install_packages.sh WHO PACKAGE...
#   WHO: the script asking, to start the line with ("setup", "fuzz", ...).
set -euo pipefail
who="$1"
shift
missing=()
for p in "$@"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
sudo_cmd=()
[ "$(id -u)" -ne 0 ] && sudo_cmd=(sudo)
echo "$who: installing ${missing[*]}"
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
if ! { "${sudo_cmd[@]}" apt-get update -qq &&
  "${sudo_cmd[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"; } >"$log" 2>&1; then
  cat "$log" >&2
  echo "$who: installing ${missing[*]} failed (apt-get's output is above)" >&2
  exit 1
fi
