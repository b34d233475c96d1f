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
      if (e.kind() != ErrorKind::kTimeout) throw;
      // A peer that is alive but silent for the whole wait did not take part in this refit (its
      // init or its receive failed, or it never ran): its own error says why.
      if (expired(deadline))
        fail(ErrorKind::kTimeout,
             "{} ({}; the cause is likely on its side: an init or receive that failed, never ran or is stuck)",
             e.what(),
             same_host(process) ? fmt::format("its process, pid {}, is alive", process.pid) : "no word from it");
    }
    if (auto gone = gone_peer(label, process)) throw *gone;
  }
}

std::optional<Error> gone_peer(const std::string& label, const ProcessIdentity& process, const std::string& cause) {
  if (!process_is_gone(process)) return std::nullopt;
  return Error(ErrorKind::kPeerLost, fmt::format("lost {}: its process (pid {}) is gone{}", label, process.pid,
                                                 cause.empty() ? "" : fmt::format(" ({})", cause)));
}

}  // namespace refit
