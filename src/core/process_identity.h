// Which process an engine runs in: boot id, pid and start time. Peers on the same host use it
// to notice at once that the other process is gone, whatever the transport (UCX's own
// keepalive does not cover every transport combination, and not every transport has one).
#pragma once

#include <cstdint>
#include <string>

namespace refit {

struct ProcessIdentity {
  std::string boot_id;      // /proc/sys/kernel/random/boot_id: same value = same host, same boot
  int32_t pid = 0;
  uint64_t start_time = 0;  // field 22 of /proc/<pid>/stat, so that a reused pid is not mistaken
};

ProcessIdentity this_process();

// True only when `peer` ran on this host and that process no longer exists; false when it lives
// or when it is on another host (nothing can be said from here).
bool process_is_gone(const ProcessIdentity& peer);

}  // namespace refit
