#!/usr/bin/env bash
# Simulated hosts on one Linux machine, for tests and benchmarks that cross a network.
#
# Each host has what separates real hosts: its own network namespace (one veth link to a switch),
# its own mount namespace with a private /dev/shm and /tmp, its own IPC, PID (with its own /proc)
# and UTS (hostname) namespaces. The switch is a bridge in a namespace of its own, so nothing is
# added to this machine's own network; hosts get 10.213.<net>.<i>/24 and reach only each other.
# Each host's link can be shaped with tc's token bucket (tbf), both directions, and taken down.
# Needs root, iproute2, util-linux (nsenter, unshare), procps (pgrep) and python3 (each host's init).
#
# Usage:
#   simhosts.sh up TAG N [--rate RATE]   make hosts TAG-h1 .. TAG-hN (RATE as tc: 2gbit, 500mbit)
#   simhosts.sh exec TAG I CMD...        run CMD on host I (its namespaces; working directory kept)
#   simhosts.sh addr TAG I               host I's address
#   simhosts.sh shape TAG I RATE|off     shape host I's link (both directions)
#   simhosts.sh link TAG I up|down       take host I's link down (a cable pulled) or up again
#   simhosts.sh kill TAG I               SIGKILL every process of host I (a host that died)
#   simhosts.sh restart TAG I            a fresh host I in place of a dead one, same address
#   simhosts.sh down TAG                 remove every host of TAG, its processes and links
#   simhosts.sh clean                    remove every TAG whose owner process is gone
#   simhosts.sh with N [--rate RATE] -- CMD...
#                                        up, run CMD with SIMHOSTS_TAG set, then down (also on
#                                        failure or Ctrl-C); exits with CMD's status
#   simhosts.sh check                    exit 0 if hosts can be made here, else say why (exit 1)
# TAG: up to 6 letters and digits. Owner of `up`: $SIMHOSTS_OWNER (default: the caller's pid);
# `clean` removes hosts whose owner is gone, so a killed test leaves nothing behind for long.
set -euo pipefail

STATE_ROOT=/run/refit-simhosts

die() { echo "simhosts: $*" >&2; exit 1; }

check() {
  [ "$(id -u)" -eq 0 ] || { echo "simhosts: needs root (namespaces, veth links)"; return 1; }
  local tool
  for tool in ip tc nsenter unshare pgrep python3; do
    command -v "$tool" >/dev/null 2>&1 || { echo "simhosts: '$tool' is missing (apt-get install iproute2 util-linux procps python3)"; return 1; }
  done
  local probe="refitprobe$$"
  if ! ip netns add "$probe" 2>/dev/null; then
    echo "simhosts: cannot make a network namespace here (ip netns add failed)"
    return 1
  fi
  ip netns del "$probe"
  if ! unshare --mount --uts --ipc --pid --fork --mount-proc true 2>/dev/null; then
    ip netns del "$probe" 2>/dev/null || true
    echo "simhosts: cannot make mount/UTS/IPC/PID namespaces here (unshare failed)"
    return 1
  fi
  return 0
}

state() { echo "$STATE_ROOT/$1"; }
switch_ns() { echo "refit-$1-sw"; }
host_ns() { echo "refit-$1-h$2"; }
net_of() { cat "$(state "$1")/net"; }
addr() { echo "10.213.$(net_of "$1").$(($2 + 1))"; }
holder_pid() { cat "$(state "$1")/h$2.pid" 2>/dev/null || true; }

valid_tag() { [[ "$1" =~ ^[a-z0-9]{1,6}$ ]] || die "TAG '$1': expected 1 to 6 lower-case letters or digits"; }
valid_host() {
  [ -d "$(state "$1")" ] || die "no hosts named '$1' (simhosts.sh up $1 N first)"
  [[ "$2" =~ ^[0-9]+$ ]] && [ "$2" -ge 1 ] && [ "$2" -le "$(cat "$(state "$1")/count")" ] ||
    die "host '$2' of '$1': expected 1..$(cat "$(state "$1")/count")"
}

# Rate and burst for tbf: the burst holds 5 ms at the rate (at least 256 KiB, more than one GSO
# segment of 64 KiB), so the shaper neither starves big segments nor lets bursts run far ahead.
shape_dev() {
  local ns="$1" dev="$2" rate="$3"
  ip netns exec "$ns" tc qdisc del dev "$dev" root 2>/dev/null || true
  [ "$rate" = off ] && return 0
  local bits
  bits=$(python3 -c '
import re, sys
m = re.fullmatch(r"([0-9.]+)([kmg]?)(bit|bps)", sys.argv[1].lower())
if not m: sys.exit(1)
v = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)] * (8 if m.group(3) == "bps" else 1)
print(int(v))' "$rate") || die "rate '$rate': expected a tc rate such as 2gbit, 500mbit or 100mbps"
  local burst=$((bits / 8 / 200))
  [ "$burst" -lt 262144 ] && burst=262144
  ip netns exec "$ns" tc qdisc add dev "$dev" root tbf rate "$rate" burst "$burst" latency 100ms
}

start_host() {
  local tag="$1" i="$2" dir
  dir=$(state "$tag")
  # Folders under /tmp that every host must still see: this repository (its scripts and build)
  # and the caller's working directory, when they live there.
  local keep=() here
  here=$(cd "$(dirname "$0")/.." && pwd)
  for path in "$here" "$PWD"; do if [[ "$path" == /tmp/* ]]; then keep+=("$path"); fi; done
  mkdir -p "$dir/keep$i"
  # The host's init: PID 1 of its PID namespace, reaps orphans, mounts the host's private
  # /dev/shm and /tmp, names the host. Killing it kills every process of the host.
  ip netns exec "$(host_ns "$tag" "$i")" unshare --mount --uts --ipc --pid --fork --mount-proc --propagation private \
    python3 -c '
import os, signal, subprocess, sys, time
name, ready, stage, keep = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
def mount(*args):
    subprocess.run(["mount", *args], check=True)
subprocess.run(["hostname", name], check=True)
staged = []
for k, path in enumerate(keep):
    os.makedirs(f"{stage}/{k}", exist_ok=True)
    mount("--bind", path, f"{stage}/{k}")
    staged.append((f"{stage}/{k}", path))
for where in ("/dev/shm", "/tmp"):
    mount("-t", "tmpfs", "-o", "mode=1777", "tmpfs", where)
for source, path in staged:
    os.makedirs(path, exist_ok=True)
    mount("--bind", source, path)
signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
open(ready, "w").write("ready\n")
while True:
    try:
        os.waitpid(-1, 0)
    except ChildProcessError:
        time.sleep(0.2)
' "$tag-h$i" "$dir/h$i.ready" "$dir/keep$i" "${keep[@]}" </dev/null >/dev/null 2>&1 &
  local launcher=$!
  # `unshare --fork` makes the init a child of unshare: find the process in the new PID namespace.
  local waited=0 pid=""
  while [ $waited -lt 100 ]; do
    if [ -f "$dir/h$i.ready" ]; then
      pid=$(pgrep -P "$launcher" -f python3 | head -n1 || true)
      [ -n "$pid" ] && break
    fi
    sleep 0.05
    waited=$((waited + 1))
  done
  [ -n "$pid" ] || die "host $i of '$tag' did not start"
  rm -f "$dir/h$i.ready"
  echo "$pid" >"$dir/h$i.pid"
}

up() {
  local tag="$1" count="$2" rate=off
  shift 2
  while [ $# -gt 0 ]; do
    case "$1" in
      --rate) rate="$2"; shift 2 ;;
      *) die "up: unknown option '$1'" ;;
    esac
  done
  valid_tag "$tag"
  [[ "$count" =~ ^[0-9]+$ ]] && [ "$count" -ge 1 ] && [ "$count" -le 64 ] || die "N '$count': expected 1..64"
  check >/dev/null || die "$(check)"
  local dir
  dir=$(state "$tag")
  [ -e "$dir" ] && die "hosts '$tag' exist already (simhosts.sh down $tag)"
  mkdir -p "$dir"
  echo "${SIMHOSTS_OWNER:-$PPID}" >"$dir/owner"
  echo "$count" >"$dir/count"
  # A /24 of its own per tag, so that several tags can coexist.
  local net
  net=$(( ( $(printf '%s' "$tag" | cksum | cut -d' ' -f1) % 200 ) + 20 ))
  while grep -qx "$net" "$STATE_ROOT"/*/net 2>/dev/null; do net=$(( (net - 19) % 200 + 20 )); done
  echo "$net" >"$dir/net"
  local sw
  sw=$(switch_ns "$tag")
  ip netns add "$sw"
  ip -n "$sw" link add br0 type bridge
  ip -n "$sw" link set br0 up
  ip -n "$sw" link set lo up
  local i
  for i in $(seq 1 "$count"); do
    local ns
    ns=$(host_ns "$tag" "$i")
    ip netns add "$ns"
    ip link add "rf$tag$i" type veth peer name "rs$tag$i"
    ip link set "rf$tag$i" netns "$ns"
    ip link set "rs$tag$i" netns "$sw"
    ip -n "$ns" link set "rf$tag$i" name eth0
    ip -n "$ns" addr add "$(addr "$tag" "$i")/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$ns" link set lo up
    ip -n "$sw" link set "rs$tag$i" master br0
    ip -n "$sw" link set "rs$tag$i" up
    shape "$tag" "$i" "$rate"
    start_host "$tag" "$i"
  done
}

shape() {
  local tag="$1" i="$2" rate="$3"
  shape_dev "$(host_ns "$tag" "$i")" eth0 "$rate"        # what host i sends
  shape_dev "$(switch_ns "$tag")" "rs$tag$i" "$rate"     # what host i receives
}

host_exec() {
  local tag="$1" i="$2"
  shift 2
  valid_host "$tag" "$i"
  local pid
  pid=$(holder_pid "$tag" "$i")
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null || die "host $i of '$tag' is down (simhosts.sh restart $tag $i)"
  exec nsenter --target "$pid" --net --mount --uts --ipc --pid --wd="$PWD" -- "$@"
}

kill_host() {
  local tag="$1" i="$2" pid
  pid=$(holder_pid "$tag" "$i")
  [ -n "$pid" ] || return 0
  kill -KILL "$pid" 2>/dev/null || true
  # The kernel kills the rest of the PID namespace when its init dies; wait until it has.
  local waited=0
  while kill -0 "$pid" 2>/dev/null && [ $waited -lt 200 ]; do sleep 0.05; waited=$((waited + 1)); done
  rm -f "$(state "$tag")/h$i.pid"
}

down() {
  local tag="$1" dir i
  dir=$(state "$tag")
  if [ -f "$dir/count" ]; then
    for i in $(seq 1 "$(cat "$dir/count")"); do kill_host "$tag" "$i"; done
  fi
  local ns
  for ns in $(ip netns list | awk '{print $1}' | grep -E "^refit-$tag-(sw|h[0-9]+)$" || true); do
    ip netns del "$ns" 2>/dev/null || true
  done
  rm -rf "$dir"
}

clean() {
  local dir tag owner
  for dir in "$STATE_ROOT"/*; do
    [ -d "$dir" ] || continue
    tag=$(basename "$dir")
    owner=$(cat "$dir/owner" 2>/dev/null || echo 0)
    if [ "$owner" -le 1 ] || ! kill -0 "$owner" 2>/dev/null; then down "$tag"; fi
  done
  # Namespaces of a tag whose state is gone (a machine that rebooted /run, say).
  local ns
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E '^refit-[a-z0-9]+-(sw|h[0-9]+)$' || true); do
    tag=${ns#refit-}
    tag=${tag%-*}
    [ -d "$STATE_ROOT/$tag" ] || ip netns del "$ns" 2>/dev/null || true
  done
}

with() {
  local count="$1"
  shift
  local up_args=()
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do up_args+=("$1"); shift; done
  [ "${1:-}" = "--" ] || die "with: expected -- before the command"
  shift
  clean
  WITH_TAG="w$$"
  WITH_TAG=${WITH_TAG:0:6}
  trap 'down "$WITH_TAG"' EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM
  SIMHOSTS_OWNER=$$ up "$WITH_TAG" "$count" "${up_args[@]}"
  local status=0
  SIMHOSTS_TAG="$WITH_TAG" "$@" || status=$?
  return $status
}

command="${1:-}"
[ -n "$command" ] || { sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 2; }
shift
case "$command" in
  check) check ;;
  up) [ $# -ge 2 ] || die "usage: simhosts.sh up TAG N [--rate RATE]"; up "$@" ;;
  exec) [ $# -ge 3 ] || die "usage: simhosts.sh exec TAG I CMD..."; host_exec "$@" ;;
  addr) [ $# -eq 2 ] || die "usage: simhosts.sh addr TAG I"; valid_host "$1" "$2"; addr "$1" "$2" ;;
  shape) [ $# -eq 3 ] || die "usage: simhosts.sh shape TAG I RATE|off"; valid_host "$1" "$2"; shape "$@" ;;
  link)
    [ $# -eq 3 ] && [[ "$3" =~ ^(up|down)$ ]] || die "usage: simhosts.sh link TAG I up|down"
    valid_host "$1" "$2"
    ip -n "$(switch_ns "$1")" link set "rs$1$2" "$3"
    if [ "$3" = up ]; then
      # Back only once the host's end carries traffic again (programs that start now, UCX among
      # them, skip an interface without carrier).
      for _ in $(seq 1 100); do
        ip -n "$(host_ns "$1" "$2")" link show eth0 | grep -q "state UP" && break
        sleep 0.05
      done
      # Addresses that failed to resolve while the link was down stay FAILED in the other
      # hosts' neighbour tables for a while (connect() then says "no route to host"): forget them,
      # as a switch port coming back announces itself.
      for i in $(seq 1 "$(cat "$(state "$1")/count")"); do
        ip -n "$(host_ns "$1" "$i")" neigh flush all 2>/dev/null || true
      done
    fi
    ;;
  kill) [ $# -eq 2 ] || die "usage: simhosts.sh kill TAG I"; valid_host "$1" "$2"; kill_host "$1" "$2" ;;
  restart) [ $# -eq 2 ] || die "usage: simhosts.sh restart TAG I"; valid_host "$1" "$2"; kill_host "$1" "$2"; start_host "$1" "$2" ;;
  down) [ $# -eq 1 ] || die "usage: simhosts.sh down TAG"; down "$1" ;;
  clean) clean ;;
  with) [ $# -ge 3 ] || die "usage: simhosts.sh with N [--rate RATE] -- CMD..."; with "$@" ;;
  *) die "unknown command '$command' (run without arguments for help)" ;;
esac
