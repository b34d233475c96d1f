#include "engine/peer_wait.h"

#include <algorithm>

#include "core/fail.h"

namespace refit {

Bytes receive_watching(Transport& transport, PeerId peer, const std::string& label, const ProcessIdentity& process,
                       Deadline deadline) {
  while (true) {
    try {
      return transport.receive(peer, std::min(deadline, Clock::now() + kLivenessSlice));
    } catch (const Error& e) {
      if (e.kind() != ErrorKind::kTimeout || expired(deadline)) throw;
    }
    if (process_is_gone(process))
      fail(ErrorKind::kPeerLost, "lost {}: its process (pid {}) is gone", label, process.pid);
  }
}

}  // namespace refit
