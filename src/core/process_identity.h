// Which process an engine runs in, and on which host. Peers on the same host use it to notice at
// once that the other process is gone, whatever the transport (UCX's own keepalive does not cover
// every transport combination, and not every transport has one), and to decide whether they may
// share memory. "Same host" is strict: the same boot and the same PID, IPC, mount, network and UTS
// namespaces. Containers and the simulated hosts of the tests share a kernel (and its boot id)
// but not their pids, /dev/shm or /proc, so a peer in other namespaces is remote.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

namespace refit {

struct ProcessIdentity {
  std::string boot_id;      // /proc/sys/kernel/random/boot_id
  uint64_t namespaces = 0;  // a hash of this process's pid, ipc, mnt, net and uts namespace ids
  std::string hostname;     // for messages: names the host of a lost peer
  int32_t pid = 0;          // in its own PID namespace
  uint64_t start_time = 0;  // field 22 of /proc/<pid>/stat, so that a reused pid is not mistaken
};

ProcessIdentity this_process();

// How often a peer on this host is looked up while something waits for it: often enough to report
// a killed peer at once, rarely enough that a destination waiting for hundreds of sources (or as
// many sources waiting for it, on one host) spends nothing on it (each look reads /proc).
inline constexpr auto kLivenessSlice = std::chrono::milliseconds(200);

// True when `peer` runs on this host as defined above (its memory can be mapped, its pid checked).
bool same_host(const ProcessIdentity& peer);

// True only when `peer` ran on this host and that process no longer exists; false when it lives
// or when it is on another host (nothing can be said from here).
bool process_is_gone(const ProcessIdentity& peer);

// Its fields on the wire, in order (core/wire_fields.h): engine metadata and transport addresses
// carry it.
template <typename Io, typename P>  // P: ProcessIdentity, const or not
void process_identity_fields(Io& io, P& p) {
  io(p.boot_id, "boot id");
  io(p.namespaces, "namespaces");
  io(p.hostname, "hostname");
  io(p.pid, "pid");
  io(p.start_time, "start time");
}

}  // namespace refit
